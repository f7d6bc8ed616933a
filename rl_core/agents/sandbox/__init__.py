"""Sandboxes: where an episode's code runs, isolated from the process that hosts the episode.

    sandbox = LocalSandbox()            # or ContainerSandbox(image="python:3.11-slim")
    sandbox.start()                     # once per episode
    result = sandbox.run_python("print(6 * 7)")
    sandbox.write("data.csv", b"x\\n1\\n"); sandbox.read("data.csv")
    sandbox.stop()                      # at the episode's end (every started process and file goes)

A sandbox gives each episode a working directory of its own (`/sandbox`, empty at `start`), runs a command or Python
code there under `Limits` (wall and CPU time, memory, processes, file and disk size, output), and reads and writes
files inside that directory only. What a run reports is a `RunResult`; `RunResult.text()` is what a tool answers the
model. The backends (`LocalSandbox`, `ContainerSandbox`) say what they isolate; `docs/security.md` states it per
backend. `python_tool(sandbox)` is the built-in code tool an environment hands the model.
"""

from rl_core.agents.sandbox.base import Limits, RunResult, Sandbox, SandboxError, python_tool
from rl_core.agents.sandbox.container import ContainerSandbox, container_runtime
from rl_core.agents.sandbox.local import LocalSandbox, local_sandbox_problem

__all__ = ["ContainerSandbox", "Limits", "LocalSandbox", "RunResult", "Sandbox", "SandboxError", "container_runtime",
           "local_sandbox_problem", "python_tool"]
