"""The model of a recipe, from its ``config.json`` alone: where that file comes from and the parameter counts and
shapes it implies.

What the folder offers, one module each (imported where used: importing the folder costs nothing):

* :mod:`.config`: Where a recipe's model ``config.json`` comes from: a local directory, a checked-in file, or the
  Hugging Face hub.
* :mod:`.shape`: Parameter counts and shapes of a model, from its ``config.json`` alone.
"""

__all__ = ["config", "shape"]
