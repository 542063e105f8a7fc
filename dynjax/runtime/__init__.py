"""dynjax runtime: runs what the build side (``dynjax.control``, the core) produced.

Never imports tracing code: Programs arrive built, and compiled code arrives through
``Kernel`` build thunks.
"""

from dynjax.runtime._program import Block as Block
from dynjax.runtime._program import Instr as Instr
from dynjax.runtime._program import Kernel as Kernel
from dynjax.runtime._program import Op as Op
from dynjax.runtime._program import Program as Program
from dynjax.runtime._program import ProgramBuilder as ProgramBuilder
from dynjax.runtime._vm import VM as VM
from dynjax.runtime._vm import VMStats as VMStats
from dynjax.runtime._vm import collect_stats as collect_stats
from dynjax.runtime._vm import stats as stats

__all__ = ["Block", "Instr", "Kernel", "Op", "Program", "ProgramBuilder", "VM", "VMStats",
           "collect_stats", "stats"]
