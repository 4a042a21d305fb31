"""``python tests/reliability/limited_rank.py <train args>``: ``llmjp_ds.train`` with a real file-size limit
(``RLIMIT_FSIZE``, SIGXFSZ ignored, so a write past it fails with EFBIG as a full disk fails with ENOSPC) on
the rank named by ``LIMIT_RANK`` (every rank when unset), of ``LIMIT_BYTES`` bytes. A torchrun worker script."""

import os
import resource
import runpy
import signal
import sys

if os.environ.get("LIMIT_RANK") in (None, os.environ.get("RANK", "0")):
    limit = int(os.environ["LIMIT_BYTES"])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
sys.argv = ["llmjp_ds.train", *sys.argv[1:]]
runpy.run_module("llmjp_ds.train", run_name="__main__", alter_sys=True)
