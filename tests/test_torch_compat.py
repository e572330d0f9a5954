"""Every private torch name plait uses resolves on the installed torch (plait/_torch_compat.py)."""

import re

import pytest
import torch

from plait import _torch_compat as compat


@pytest.mark.parametrize("resolver", compat.RESOLVERS, ids=lambda f: f.__name__)
def test_every_private_name_resolves(resolver):
    """On a torch plait was checked on, even the optional names are present."""
    assert resolver() is not None


def test_the_installed_torch_is_at_or_above_the_floor():
    assert compat.torch_version() >= compat.TORCH_FLOOR
    compat.check_torch_version()
    floor = ".".join(map(str, compat.TORCH_FLOOR))
    pyproject = open("pyproject.toml").read()
    assert re.search(rf'"torch>={re.escape(floor)}"', pyproject), "pyproject's floor differs"


def test_functions_of_live_objects_resolve():
    op = compat.c10d_op("allreduce_")
    assert op.name() == "c10d::allreduce_"
    assert callable(compat.redispatch_boxed(op))
    assert compat.is_view(torch.ones(4)[1:]) and not compat.is_view(torch.ones(4))
    assert compat.dispatch_has_kernel("c10d::allreduce_", "BackendSelect") in (True, False)
    placement = compat.strided_shard(0, 3)
    assert placement.dim == 0
    use_count = compat.storage_use_count()
    t = torch.ones(4)
    assert use_count(t) >= 1


def test_a_missing_name_is_one_clear_error():
    with pytest.raises(compat.TorchCompatError) as err:
        compat._resolve("torch.distributed", "_no_such_thing_in_torch")
    msg = str(err.value)
    assert "torch.distributed._no_such_thing_in_torch" in msg and torch.__version__ in msg
    assert "checked on torch" in msg and "\n" not in msg
    assert compat._resolve("torch.distributed", "_no_such_thing", required=False) is None


def test_no_module_outside_compat_imports_a_private_torch_name():
    """Private torch names are reached only through plait/_torch_compat.py."""
    from pathlib import Path

    root = Path(compat.__file__).resolve().parents[1]
    pattern = re.compile(r"^\s*(from|import)\s+torch[\w.]*\._\w|torch\._C\._|\._flatten\(|"
                         r"_StridedShard\(|\._is_view\(|_handle\.redispatch|\._destroy\(\)")
    offenders = []
    for folder in ("plait", "tests", "bench", "examples"):
        for path in (root / folder).rglob("*.py"):
            if path.name in ("_torch_compat.py", "test_torch_compat.py"):
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line.split("#")[0]):
                    offenders.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
