import os

# Multi-process tests spawn processes on a 2-core machine: one thread each keeps them honest.
os.environ.setdefault("OMP_NUM_THREADS", "1")
