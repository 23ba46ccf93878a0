"""Helpers the tests share (see tests/README.md): child processes (procs), crash-trial workers (crash_child),
other "hosts" (hosts), checkpoint damage (ckpt_damage), fault injection (faultinject/), a Mooncake service
(mooncake_store), the reliability lane's figures (reliability_figures), tracker readers (tracker_runs),
scripts run under another Python (vllm_spec_decode, vllm_dspark_load, speculators_draft_logits,
speculators_train) and data fixtures (data/).

``tests`` is a package (every folder has an ``__init__.py``), so pytest puts the repository's root on ``sys.path``
and tests import ``from tests.support.procs import Proc``; children that import these modules get the repository
on PYTHONPATH. (Were ``tests/`` itself on ``sys.path``, its lane folders would shadow ``vllm``, ``mooncake`` and
``speculators``.)"""

from pathlib import Path

#: this folder
SUPPORT = Path(__file__).resolve().parent
#: the repository's root
REPO = SUPPORT.parents[1]
#: a 34-conversation ShareGPT file (the fixture the CPU tests train on)
TINY_SHAREGPT = SUPPORT / "data" / "tiny_sharegpt.json"
