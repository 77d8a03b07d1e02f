"""Shared test set-up: one thread per process (2 cores, many processes), headless views."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DTLAB_HEADLESS", "1")
os.environ.setdefault("DTLAB_TIMEOUT_S", "60")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none on this machine")
