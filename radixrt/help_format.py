"""The help format of radixrt's commands and benchmarks: each option's default shown."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already says
    what the default is (e.g. an environment variable, whose value must not be
    printed, or a switch that turns something off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "(default" in text:
            return text
        return super()._get_help_string(action) or ""
