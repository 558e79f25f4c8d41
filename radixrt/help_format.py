"""The help format of radixrt's commands and benchmarks: each option's default shown."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already says
    what the default is (e.g. an environment variable, whose value must not be
    printed) or the option is an on/off switch (whose default is its absence)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if not action.option_strings or switch or "(default" in text:
            return text
        return super()._get_help_string(action) or ""
