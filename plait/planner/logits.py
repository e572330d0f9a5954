"""The model's output the loss reads (its logits), and what they hold at the memory peak.

A language model's head hands the loss ``tokens x vocab`` logits, 1/tp of them on each rank
where tensor parallelism splits the head by the vocabulary (``vocab_head``: the logits stay
sharded and the loss runs under ``loss_parallel()``). What a model outside that pattern hands
on is read off the model (:func:`plait.planner.model_stats.from_module`): a head the plan
leaves whole (one beside a logits bias) hands every rank all of them, a vocabulary-wide
classifier on one pooled token ``rows x vocab``, a classifier or a regression head its own
width, per row or per token.

What torch holds for them, per element, measured on one forward and backward (the loss a
cross-entropy: ``log_softmax`` then ``nll_loss``, which autocast runs in fp32):

* from the loss's forward to its backward, the fp32 log-softmax output (4 bytes) it saves,
  and, under a pipeline, the logits themselves (the compute dtype): the schedule keeps each
  microbatch's stage output until that microbatch's backward (GPipe: every microbatch's,
  1F1B: one);
* at the backward of the loss, besides those, the gradient of the log-softmax output and
  that of the fp32 logits (8 bytes), once: the peak, above the forward's (the logits, their
  fp32 cast under autocast and the log-softmax output: at most 10 bytes). On logits split
  over the vocabulary, torch's ``loss_parallel()`` computes both gradients in one step
  (``(onehot + exp(log_softmax)) x grad``): a zero-filled tensor, the exponential, their sum
  and the product, three of them live at once beside the saved output (12 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

# Bytes per element of the logits the loss saves for its backward: the fp32 log-softmax
# output (autocast runs log_softmax in fp32 whatever the logits' dtype).
SAVED_BYTES = 4
# Bytes per element the loss's backward makes at once: the gradient of the log-softmax
# output and the fp32 logits' gradient it computes from it; under loss_parallel() (logits
# split over the vocabulary), three fp32 tensors of its fused backward.
BACKWARD_BYTES = 8
SPLIT_BACKWARD_BYTES = 12


@dataclass(frozen=True)
class Logits:
    """Elements of the output the loss reads: per token of the main stack's sequence (a
    language model's head: its vocabulary), per row (a classifier on a pooled token); and
    whether tensor parallelism splits them over its ranks (a ``vocab_head``)."""

    per_token: float
    per_row: float = 0.0
    split: bool = True

    def elements(self, rows: int, seq: int, tp: int) -> float:
        """Elements one tp rank holds for ``rows`` rows of ``seq`` tokens."""
        whole = rows * (self.per_token * seq + self.per_row)
        return whole / tp if self.split else whole


def logits_bytes(logits: Logits, rows: int, seq: int, tp: int, dtype_bytes: int,
                 kept: float, pipelined: bool) -> float:
    """Bytes the logits of ``rows`` rows of ``seq`` tokens hold on one tp rank at the memory
    peak: per microbatch of the ``kept`` held until their backward, the loss's saved
    log-softmax output and, ``pipelined`` (the schedule keeps the stage output), the logits
    in the compute dtype (``dtype_bytes``); and once, what the loss's backward makes
    (:data:`BACKWARD_BYTES`, :data:`SPLIT_BACKWARD_BYTES` under ``loss_parallel()``)."""
    held = SAVED_BYTES + (dtype_bytes if pipelined else 0)
    backward = SPLIT_BACKWARD_BYTES if logits.split and tp > 1 else BACKWARD_BYTES
    return logits.elements(rows, seq, tp) * (held * kept + backward)
