"""Plain helpers shared by the tests (no fixtures: those live in the conftest.py files). Every test imports them one
way, ``from tests.helpers.<module> import ...``; no test imports another test module.

* :mod:`tests.helpers.paths`: where the repository, the test scripts, fixtures and golden files are.
* :mod:`tests.helpers.cli`: ``run_ftkit``, the real command line in a subprocess.
* :mod:`tests.helpers.recipes`: the tiny model config and the minimal recipe of the quick tests.
* :mod:`tests.helpers.runs`: real multi-process runs: fixtures on disk, 2-rank recipes, launching, killing, checking.
* :mod:`tests.helpers.ckpt`: synthetic checkpoint trees (HF Trainer + DeepSpeed layouts), commits, damage.
* :mod:`tests.helpers.rundir`: rank files written by hand as the ranks write them.
* :mod:`tests.helpers.doctor`: ``ftkit doctor`` runs and the recipe they share.
* :mod:`tests.helpers.readme`: the commands of the README and its docs pages, and the ``ftkit.hf`` example.
* :mod:`tests.helpers.trackers`: reading what wandb wrote offline.
* :mod:`tests.helpers.hub`: a hub cache on disk and a stand-in hub.
* :mod:`tests.helpers.netns`: hosts as network namespaces with sshd (multinode tests).
* :mod:`tests.helpers.slurm`: a real two-node Slurm cluster (slurm tests).
* :mod:`tests.helpers.browser`: headless Chromium over the DevTools protocol.
"""
