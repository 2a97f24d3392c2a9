import os
import sys

# `python -m shoal` put the working folder first on the import path (Python does so for -m): take it off before
# anything is imported from it, so that a google/, grpc_tools/ or torch/ package lying there never runs; kept only
# where shoal itself was found there (a source checkout run in place)
try:
    _here = os.path.realpath(os.getcwd())
    if (sys.path and os.path.realpath(sys.path[0]) == _here
            and os.path.dirname(os.path.dirname(os.path.realpath(__file__))) != _here):
        del sys.path[0]
except OSError:  # the working folder is gone: nothing can be imported from it
    pass

import gc  # noqa: E402

from shoal.frontend.cli import main  # noqa: E402

status = main()
# the work is done and its files closed: what is left is the interpreter's teardown, whose garbage collections walk
# torch's whole heap (a quarter of a CPU-second per run). Frozen objects are still freed by reference counting; only
# the teardown's search for cycles leaves them out
gc.freeze()
sys.exit(status)
