"""CliReference: the `kvferry` sub-commands' flags, read from their argparse parsers."""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from scripts.docsgen.markdown import code, generated_header, table
from services import cli


def _sub_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _portable(text: str) -> str:
    """Machine-specific paths in defaults or help become the variables they come from."""
    return text.replace(str(Path.home()), "~")


@contextlib.contextmanager
def _documented_environment() -> Iterator[None]:
    """Parsers read $KVFERRY_* and $POD_NAME for defaults: build them as on a machine that sets none."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(("KVFERRY_", "POD_"))}
    for key in saved:
        del os.environ[key]
    try:
        yield
    finally:
        os.environ.update(saved)


class CliReference:
    """Renders one section per sub-command (and nested sub-command) of the console script."""

    def render(self) -> str:
        out = [generated_header("CLI reference", "the argparse parsers of `services/cli.py`'s sub-commands")]
        out.append(
            "One console script, `kvferry`, with one sub-command per deployable. Each sub-command imports "
            "only what it needs, so `kvferry router`, `kvferry kvstore` and `kvferry operator` never "
            "import torch. `kvferry COMMAND --help` prints the same flags.\n\n"
        )
        out.append(
            table(["command", "what it runs"], [(code(f"kvferry {n}"), h) for n, _, h in cli.SUBCOMMANDS])
        )
        for name, _target, help_text in cli.SUBCOMMANDS:
            with _documented_environment():
                top = cli.build_parser([name])
            out.append(self._section(f"kvferry {name}", _sub_parsers(top)[name], level=2, lead=help_text))
        return "".join(out)

    def _section(self, prog: str, parser: argparse.ArgumentParser, level: int, lead: str = "") -> str:
        out = [f"\n{'#' * level} `{prog}`\n\n"]
        if lead:
            out.append(lead[0].upper() + lead[1:] + ".\n\n")
        if parser.description:
            out.append(_portable(" ".join(parser.description.split())) + "\n\n")
        rows = [self._row(parser, a) for a in parser._actions if self._documented(a)]
        if rows:
            out.append(table(["argument", "default", "meaning"], rows))
        for sub_name, sub_parser in _sub_parsers(parser).items():
            out.append(self._section(f"{prog} {sub_name}", sub_parser, level + 1))
        return "".join(out)

    @staticmethod
    def _documented(action: argparse.Action) -> bool:
        return not isinstance(action, argparse._HelpAction | argparse._SubParsersAction) and (
            action.help != argparse.SUPPRESS
        )

    @staticmethod
    def _row(parser: argparse.ArgumentParser, action: argparse.Action) -> tuple[str, str, str]:
        if action.option_strings:
            metavar = "" if action.nargs == 0 else f" {action.metavar or action.dest.upper()}"
            if action.nargs in ("+", "*"):
                metavar += " ..."
            name = ", ".join(code(o + (metavar if o.startswith("--") else "")) for o in action.option_strings)
        else:
            name = code(action.metavar or action.dest)
        help_text = ""
        if action.help:
            params = {**vars(action), "prog": parser.prog}
            if isinstance(action.choices, list | tuple | dict):
                params["choices"] = ", ".join(map(str, action.choices))
            help_text = action.help % params if "%" in action.help else action.help
        if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
            choices = "one of " + ", ".join(code(c) for c in action.choices)
            help_text = f"{help_text.rstrip('.')}; {choices}" if help_text else choices.capitalize()
        default = action.default
        shown = (
            "" if default in (None, argparse.SUPPRESS, False, [], "") or action.nargs == 0 else code(default)
        )
        return name, _portable(shown), _portable(" ".join(help_text.split()))
