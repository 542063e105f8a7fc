"""dynjax control flow: loops whose shapes follow the data, conds, batched recursion.

The build side: frontends trace user code and build :class:`dynjax.runtime.Program` objects
that the runtime VM runs.
"""

from dynjax.control._cond import cond as cond
from dynjax.control._fold import Fold as Fold
from dynjax.control._fold import fold as fold
from dynjax.control._frontend import NeedsProgram as NeedsProgram
from dynjax.control._inprogram import program_runs as program_runs
from dynjax.control._inprogram import run_in_program as run_in_program
from dynjax.control._loop import loop_program as loop_program
from dynjax.control._loop import loop_stats as loop_stats
from dynjax.control._loop import while_loop as while_loop
from dynjax.control._recursion import Cell as Cell
from dynjax.control._recursion import CellValue as CellValue
from dynjax.control._recursion import Recursive as Recursive
from dynjax.control._recursion import cell as cell
from dynjax.control._recursion import recursive as recursive

__all__ = ["Cell", "CellValue", "Fold", "NeedsProgram", "Recursive", "cell", "cond", "fold",
           "loop_program", "loop_stats", "program_runs", "recursive", "run_in_program",
           "while_loop"]
