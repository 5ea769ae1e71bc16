# SPDX-License-Identifier: Apache-2.0
"""Resident host memory of this process, for the benchmarks: the kernel's peak and a sampled peak over an interval.

:func:`reset` sets the kernel's peak (``VmHWM``) back to the current size (``/proc/self/clear_refs``, Linux), so
:func:`peak` then gives the largest resident size since; :class:`Sampler` reads ``VmRSS`` every 20 ms on a thread
until :meth:`Sampler.stop`, the peak over just that interval. Both in GiB; None where ``/proc`` is not there.
"""

import threading

GIB = 1024**3


def _status(key):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024 / GIB
    except OSError:
        return None
    return None


def current():
    return _status("VmRSS")


def reset():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak():
    return _status("VmHWM")


class Sampler:
    """The peak of ``VmRSS`` from construction to :meth:`stop` (sampled every ``interval`` seconds)."""

    def __init__(self, interval=0.02):
        self._peak = current()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval, ), daemon=True)
        self._thread.start()

    def _run(self, interval):
        while not self._done.wait(interval):
            value = current()
            if value is not None and (self._peak is None or value > self._peak):
                self._peak = value

    def stop(self):
        if not self._done.is_set():
            self._done.set()
            self._thread.join()
            value = current()
            if value is not None and (self._peak is None or value > self._peak):
                self._peak = value
        return self._peak
