"""What embshard raises when it is given something it cannot use. Every kind is an
``EmbshardError`` (catch that for any of them) and keeps the builtin base it had, so
``except ValueError`` still catches bad input. Messages are one line where they can be,
naming what was wrong."""

from __future__ import annotations


class EmbshardError(Exception):
    """Base of every error embshard raises on purpose."""


class InputError(EmbshardError, ValueError):
    """A rank's batch is not valid for the sharded module; raised on every rank."""


class PlanError(EmbshardError, ValueError):
    """A plan that cannot shard the given tables; the message names each table and problem."""


class PlanningError(EmbshardError, ValueError):
    """The planner cannot plan: a bad topology or constraint, or no plan fits; the
    message says what, and how much memory is missing where."""


class CheckpointError(EmbshardError, RuntimeError):
    """A checkpoint that cannot be loaded into this model; the message says why."""


class ConfigError(EmbshardError, ValueError):
    """A config that cannot run; the message names the file and the key."""
