"""Imported last by the forkserver that ranks fork from (config.plugins.forkserver_context): freezes what the server
imported (torch, shoal), so that no garbage collection walks that heap again, in the server or in a rank forked from
it (Python's advice for a process that forks: gc.freeze() before fork), nor at the server's exit: about a second
less between a job's last line and the end of `shoal run` on a busy 2-core machine. Frozen objects are still freed by
reference counting; only the collector's search for cycles leaves them out (module state, kept until exit anyway)."""
import gc

gc.freeze()
