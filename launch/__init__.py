"""ftkit's rank side: what runs on every node (training entry, data pipeline, test fixtures).

Installed as ``ftkit.launch``. Importing this package must stay cheap: modules here import torch, transformers
and friends inside functions, so the controller can import helpers without pulling in the heavy stack.
"""
