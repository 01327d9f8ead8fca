"""envhub: an environment service for agentic RL.

This module is the surface for plugin authors: the ``hookimpl`` marker, the base
classes whose docstrings are the plugin contract, and the error types a plugin raises.
"""

from envhub.agent import Agent, AgentResult, AgentSession, Budgets
from envhub.environment import Action, EnvContext, Environment, Episode, Evaluation, StepResult, Task
from envhub.errors import (
    BuildFailed,
    BuildInterrupted,
    CapacityExceeded,
    Conflict,
    EnvhubError,
    Gone,
    InvalidRequest,
    NotFound,
    SandboxError,
    StartupError,
)
from envhub.hookspecs import hookimpl
from envhub.network import NetworkMode
from envhub.sandbox import BuildRequest, ExecResult, ImageBuilder, Limits, Sandbox, SandboxSpec, Sidecar

__version__ = "0.1.0"

__all__ = [
    "Action",
    "Agent",
    "AgentResult",
    "AgentSession",
    "Budgets",
    "BuildFailed",
    "BuildInterrupted",
    "BuildRequest",
    "CapacityExceeded",
    "Conflict",
    "EnvContext",
    "Environment",
    "EnvhubError",
    "Episode",
    "Evaluation",
    "ExecResult",
    "Gone",
    "ImageBuilder",
    "InvalidRequest",
    "Limits",
    "NetworkMode",
    "NotFound",
    "Sandbox",
    "SandboxError",
    "SandboxSpec",
    "Sidecar",
    "StartupError",
    "StepResult",
    "Task",
    "hookimpl",
]
