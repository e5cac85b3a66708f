"""ftkit schema: the recipe's JSON Schema (for editors) or its Markdown reference."""

from __future__ import annotations

import json

import click

from ftkit.recipe.reference import json_schema, markdown_reference


@click.command(
    "schema",
    epilog="""\b
Examples:
  ftkit schema > recipe.schema.json   # editor hint: # yaml-language-server: $schema=recipe.schema.json
  ftkit schema --markdown > docs/recipe.md
""",
)
@click.option("--markdown", is_flag=True, help="Print the Markdown recipe reference instead of the JSON Schema.")
def command(markdown: bool) -> None:
    """Print the JSON Schema of a recipe (every field, type, default and doc), generated from the recipe model."""
    if markdown:
        click.echo(markdown_reference(), nl=False)
    else:
        click.echo(json.dumps(json_schema(), indent=2))
