"""The ``moetrace`` command line: a thin typer layer over the library.

Commands live in the modules of this package (one per command family), each with ``register(app)``. Importing this module imports
no heavy dependency, so ``moetrace --help`` works on a bare install.
"""

from __future__ import annotations

import gc
import importlib

import typer

from moetrace import __version__

app = typer.Typer(
    name="moetrace",
    help=(
        "Record which experts every token of every request activates in a Mixture-of-Experts model, "
        "find the structure in it, and turn it into expert placements and micro-batch groups.\n\n"
        "Start with: moetrace demo -o demo-out"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode=None,
)

_COMMAND_MODULES = (
    "moetrace.cli.collect",
    "moetrace.cli.checkpoint",
    "moetrace.cli.trace",
    "moetrace.cli.synth",
    "moetrace.cli.imports",
    "moetrace.cli.profile",
    "moetrace.cli.analyze",
    "moetrace.cli.place",
    "moetrace.cli.a2a",
    "moetrace.cli.advise",
    "moetrace.cli.calibrate",
    "moetrace.cli.dashboard",
    "moetrace.cli.demo",
    "moetrace.cli.route",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"moetrace {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """moetrace: expert-activation traces for MoE serving."""


for _name in _COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    try:
        app(prog_name="moetrace")
    finally:
        # The command is over (its files written and closed, its threads joined): the interpreter's
        # collections at exit would only walk the objects its libraries made (~0.2-0.4 s after
        # `compare`, measured in docs/benchmarks.md 2h). Frozen, they are freed as the modules are
        # cleared, without that walk.
        gc.freeze()


if __name__ == "__main__":
    main()
