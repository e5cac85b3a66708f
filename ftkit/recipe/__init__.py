"""The recipe: its schema (declared once), loading with overrides and one-line errors, cross-key rules, the generated
reference and scaffold.

What the folder offers, one module each (imported where used: importing the folder costs nothing):

* :mod:`.load`: Load, override and validate a recipe.
* :mod:`.reference`: The recipe reference (Markdown) and JSON Schema, both generated from :mod:`ftkit.recipe.schema`
  so they cannot drift.
* :mod:`.rules`: Rules across recipe keys that the schema's per-field types cannot state: which ZeRO stage/offload
  combinations DeepSpeed can run, and which keys belong to which sharding backend.
* :mod:`.scaffold`: Commented recipes: every key with its one-line doc (from :mod:`ftkit.recipe.schema`) above it.
* :mod:`.schema`: The recipe's fields: name, type, default and one line of documentation, declared once.
"""

__all__ = ["load", "reference", "rules", "scaffold", "schema"]
