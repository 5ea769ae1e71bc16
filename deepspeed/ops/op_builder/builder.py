# SPDX-License-Identifier: Apache-2.0
"""The op builder: how one native op (a C++ or CUDA extension under ``csrc/``) is found, built and loaded.

An :class:`OpBuilder` names its sources and flags; the same description builds the op two ways:

* **prebuilt**: ``DS_BUILD_OPS=1 pip install .`` (or ``DS_BUILD_<NAME>=1`` for one op) compiles it into the
  package as the module :meth:`OpBuilder.absolute_name`; :meth:`OpBuilder.load` imports that module when it is
  there;
* **just in time**: otherwise :meth:`OpBuilder.load` compiles it on first use with ``torch.utils.cpp_extension``
  and ninja, into a build folder of its own (:meth:`OpBuilder.jit_build_dir`). The folder's name carries a hash
  of everything the binary depends on (the op's source and header files, its flags, the Python ABI tag, the
  torch and CUDA versions), so installs of different versions never share a folder, a lock or a rebuild, and an
  unchanged op is only ever compiled once per machine.

An op is an acceleration, never a requirement: :meth:`OpBuilder.incompatible_reason` says why it cannot be built
here (no C++ compiler, a torch without CUDA, no nvcc), and every caller keeps a torch implementation to fall back
on (``deepspeed.ops.native.load_op`` logs the one-line note).

This module imports only the standard library at import time (torch is imported where it is needed), so
``setup.py`` can load the builders without importing the ``deepspeed`` package.
"""

import contextlib
import hashlib
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time

_OPS_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../deepspeed/ops
_REPO_ROOT = os.path.dirname(os.path.dirname(_OPS_DIR))  # the checkout, when running from one
_SOURCE_SUFFIXES = (".cpp", ".cc", ".cu", ".cuh", ".h", ".hpp")


def csrc_root():
    """The folder holding the native sources: ``deepspeed/ops/csrc`` in an installed package, else the checkout's
    top-level ``csrc``. Raises RuntimeError when neither exists (a package installed without its sources)."""
    for candidate in (os.path.join(_OPS_DIR, "csrc"), os.path.join(_REPO_ROOT, "csrc")):
        if os.path.isdir(candidate):
            return candidate
    raise RuntimeError(f"the native sources (csrc) were not found under {_OPS_DIR} or {_REPO_ROOT}; reinstall the "
                       "package (pip install .) so that they are shipped with it")


def jit_cache_root():
    """Where JIT builds go: ``$TORCH_EXTENSIONS_DIR`` if set, else ``$XDG_CACHE_HOME/deepspeed_ops`` (default
    ``~/.cache/deepspeed_ops``)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        return os.path.abspath(os.path.expanduser(root))
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "deepspeed_ops")


@contextlib.contextmanager
def build_lock(build_dir):
    """Hold the build folder's lock (``<build_dir>.build-lock``, an ``flock``) around torch's JIT build.

    torch serialises builds of one folder with a plain file, ``<build_dir>/lock``, created by whoever builds and
    removed when it is done; every later load, even of a finished build, waits while that file exists. A build that
    is killed (a job stopped mid-compile) leaves it behind, and every later load of the op would wait forever.
    Loads here take this ``flock`` first: the kernel releases it when its holder dies, so one that holds it knows no
    process of this package is building the folder, and a ``lock`` file it finds was left by a dead build; it is
    removed, with a warning. Without ``fcntl`` (not POSIX) nothing changes.
    """
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(build_dir.rstrip(os.sep) + ".build-lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = os.path.join(build_dir, "lock")
            if os.path.exists(stale):
                print(f"[deepspeed] removing {stale}: left by a build of this op that did not finish (killed?)",
                      file=sys.stderr)
                try:
                    os.remove(stale)
                except FileNotFoundError:
                    pass
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def command_path(command):
    """The full path of ``command`` (a name or a path, as ``CXX`` may hold), or None when it is not there."""
    if os.path.isabs(command):
        return command if os.access(command, os.X_OK) else None
    return shutil.which(command)


def cxx_compiler():
    """The C++ compiler torch's extension builder uses (``$CXX``, default ``c++``), or None if absent."""
    return command_path(os.environ.get("CXX", "c++"))


def ninja_available():
    """Whether ``ninja`` (which torch's JIT builder requires) is on the PATH."""
    return shutil.which("ninja") is not None


def cuda_home():
    """The CUDA toolkit folder holding ``bin/nvcc``: ``$CUDA_HOME``/``$CUDA_PATH``, the ``nvcc`` on the PATH, or
    ``/usr/local/cuda``; None when no nvcc is found."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    candidates.append("/usr/local/cuda")
    for home in candidates:
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return home
    return None


def _version_line(command):
    """The first line of ``command --version``, or None if it cannot be run."""
    try:
        out = subprocess.run(command + ["--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[0] if lines else None


def cxx_version():
    """The C++ compiler's ``--version`` line, or None."""
    compiler = cxx_compiler()
    return _version_line([compiler]) if compiler else None


def nvcc_version():
    """nvcc's release as ``"major.minor"`` (e.g. ``"13.0"``), or None when there is no nvcc."""
    home = cuda_home()
    if home is None:
        return None
    try:
        out = subprocess.run([os.path.join(home, "bin", "nvcc"), "-V"],
                             capture_output=True,
                             text=True,
                             timeout=30,
                             check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", out)
    return f"{match.group(1)}.{match.group(2)}" if match else None


def get_default_compute_capabilities():
    """The CUDA architectures a prebuilt op is compiled for when ``TORCH_CUDA_ARCH_LIST`` is not set (a JIT
    build targets the GPUs it finds instead)."""
    return "8.0;8.6;9.0"


def _torch():
    import torch
    return torch


def _hash_files(digest, paths):
    for path in sorted(paths):
        digest.update(path.encode())
        with open(path, "rb") as handle:
            digest.update(handle.read())


class OpBuilder:
    """One native op: its name, sources and flags, and how it is loaded.

    Subclasses set ``NAME`` (the op's name, as upstream spells it), ``BUILD_VAR`` (the ``DS_BUILD_*`` variable
    that prebuilds it) and override :meth:`absolute_name`, :meth:`sources` and, where they need to,
    :meth:`include_paths`, :meth:`cxx_args`, :meth:`incompatible_reason`.
    """

    NAME = None
    BUILD_VAR = None
    PYTHON_MODULE = True  # a Python extension (imported by jit_load); False: a plain shared library
    _loaded_ops = {}  # op name -> loaded module, shared by every builder instance of the process

    def __init__(self, name=None):
        self.name = name or self.NAME
        self.jit_mode = False
        self.error_log = None

    # -- description ---------------------------------------------------------------------------------

    def absolute_name(self):
        """The module a prebuilt op is installed as (e.g. ``deepspeed.ops.adam.cpu_adam_op``)."""
        raise NotImplementedError(f"{type(self).__name__} does not name its module")

    def sources(self):
        """The op's source files, relative to the source root (``csrc/...``)."""
        return []

    def include_paths(self):
        """Include folders, relative to the source root."""
        return []

    def cxx_args(self):
        # No -std flag: torch's extension builder passes the standard its headers need.
        return ["-O3", "-g0"]

    def nvcc_args(self):
        return []

    def extra_ldflags(self):
        return []

    def with_cuda(self):
        return False

    def incompatible_reason(self):
        """Why this op cannot be built on this machine, or None when it can."""
        return None

    # -- compatibility -------------------------------------------------------------------------------

    def is_compatible(self, verbose=False):
        """Whether the op can be built (prebuilt or JIT) here. With ``verbose`` the reason is printed."""
        reason = self.incompatible_reason()
        if reason is not None and verbose:
            self.warning(f"{self.name} is not compatible: {reason}")
        return reason is None

    def jit_buildable(self):
        """Compatible, and ninja is there for torch's JIT builder."""
        return self.is_compatible() and ninja_available()

    def is_installed(self):
        """Whether the op was prebuilt into this install (its module can be found)."""
        try:
            return importlib.util.find_spec(self.absolute_name()) is not None
        except (ImportError, ValueError, NotImplementedError):
            return False

    def warning(self, message):
        self.error_log = message
        print(f" [WARNING]  {message}")

    def command_exists(self, command):
        return command_path(command) is not None

    def deepspeed_src_path(self, code_path):
        """``code_path`` (``csrc/...`` or a path inside it) as an absolute path."""
        if os.path.isabs(code_path):
            return code_path
        relative = code_path[len("csrc/"):] if code_path.startswith("csrc/") else code_path
        return os.path.join(csrc_root(), relative)

    def _absolute_sources(self):
        return [self.deepspeed_src_path(s) for s in self.sources()]

    def _absolute_includes(self):
        return [self.deepspeed_src_path(p) for p in self.include_paths()]

    # -- JIT builds ----------------------------------------------------------------------------------

    def build_key(self):
        """A hash of everything the built binary depends on (see the module docstring)."""
        torch = _torch()
        digest = hashlib.sha256()
        digest.update(f"{self.name}|{sys.implementation.cache_tag}|{torch.__version__}|{torch.version.cuda}".encode())
        flags = [self.cxx_args(), self.nvcc_args() if self.with_cuda() else [], self.extra_ldflags()]
        digest.update(repr(flags).encode())
        digest.update(os.environ.get("TORCH_CUDA_ARCH_LIST", "").encode())
        files = list(self._absolute_sources())
        for folder in self._absolute_includes():
            for dirpath, _, filenames in os.walk(folder):
                files += [os.path.join(dirpath, f) for f in filenames if f.endswith(_SOURCE_SUFFIXES)]
        _hash_files(digest, set(files))
        return digest.hexdigest()[:16]

    def jit_build_dir(self):
        """``<jit_cache_root()>/<name>/<python tag>_torch<version>_<cuda>_<build_key()>``."""
        torch = _torch()
        cuda = f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu"
        torch_version = re.sub(r"[^0-9A-Za-z.]", "_", torch.__version__.split("+")[0])
        leaf = f"{sys.implementation.cache_tag}_torch{torch_version}_{cuda}_{self.build_key()}"
        return os.path.join(jit_cache_root(), self.name, leaf)

    def jit_load(self, verbose=True):
        """Build the op (or reuse its build folder) with torch's JIT builder and import it (a builder whose
        ``PYTHON_MODULE`` is False gets the built library's path instead).

        Raises RuntimeError with the reason when the op cannot be built here.
        """
        reason = self.incompatible_reason()
        if reason is not None:
            raise RuntimeError(f"the {self.name} op cannot be built on this machine: {reason}")
        if not ninja_available():
            raise RuntimeError(f"building the {self.name} op just in time needs ninja (pip install ninja)")
        from torch.utils import cpp_extension

        build_dir = self.jit_build_dir()
        os.makedirs(build_dir, exist_ok=True)
        start = time.time()
        with build_lock(build_dir):
            module = cpp_extension.load(name=self.extension_name(),
                                        sources=self._absolute_sources(),
                                        extra_include_paths=self._absolute_includes(),
                                        extra_cflags=self.cxx_args(),
                                        extra_cuda_cflags=self.nvcc_args() if self.with_cuda() else None,
                                        extra_ldflags=self.extra_ldflags(),
                                        build_directory=build_dir,
                                        with_cuda=self.with_cuda(),
                                        is_python_module=self.PYTHON_MODULE,
                                        verbose=False)
        self.jit_mode = True
        if verbose:
            print(f"Loaded the {self.name} op (JIT, {time.time() - start:.1f} s) from {build_dir}")
        return module

    def extension_name(self):
        """The Python module name the op is compiled as (the last part of :meth:`absolute_name`)."""
        return self.absolute_name().rsplit(".", 1)[-1]

    # -- loading -------------------------------------------------------------------------------------

    def load(self, verbose=True):
        """The op's module: the prebuilt one if installed and importable, else a JIT build (cached per process).

        Raises RuntimeError when the op is neither installed nor buildable here.
        """
        if self.name in OpBuilder._loaded_ops:
            return OpBuilder._loaded_ops[self.name]
        module = None
        if self.is_installed():
            try:
                module = importlib.import_module(self.absolute_name())
            except ImportError as error:  # built against another torch, say: build it again for this one
                if verbose:
                    print(f"the prebuilt {self.name} op does not load ({error}); building it just in time")
        if module is None:
            module = self.jit_load(verbose)
        OpBuilder._loaded_ops[self.name] = module
        return module

    # -- install-time builds -------------------------------------------------------------------------

    def builder(self):
        """The setuptools extension that prebuilds this op (used by ``setup.py``; sources relative to it)."""
        from torch.utils import cpp_extension

        def relative(path):
            return os.path.relpath(path, _REPO_ROOT) if path.startswith(_REPO_ROOT + os.sep) else path

        kind = cpp_extension.CUDAExtension if self.with_cuda() else cpp_extension.CppExtension
        compile_args = {"cxx": self.cxx_args()}
        if self.with_cuda():
            compile_args["nvcc"] = self.nvcc_args()
        return kind(name=self.absolute_name(),
                    sources=[relative(s) for s in self._absolute_sources()],
                    include_dirs=[relative(p) for p in self._absolute_includes()],
                    extra_compile_args=compile_args,
                    extra_link_args=self.extra_ldflags())


class TorchCPUOpBuilder(OpBuilder):
    """A C++ op for the host, built with the machine's C++ compiler (OpenMP for threads)."""

    def cxx_args(self):
        return super().cxx_args() + ["-fopenmp", "-fno-math-errno"] + self.cpu_arch()

    def extra_ldflags(self):
        return ["-fopenmp"]

    def cpu_arch(self):
        """Compile for the build machine's CPU (``-march=native``) unless ``DS_BUILD_PORTABLE=1``."""
        if os.environ.get("DS_BUILD_PORTABLE", "0") == "1":
            return []
        return ["-march=native"]

    def incompatible_reason(self):
        if cxx_compiler() is None:
            return f"no C++ compiler found (CXX={os.environ.get('CXX', 'c++')})"
        return None


class CUDAOpBuilder(OpBuilder):
    """A CUDA op: needs a torch built with CUDA and an nvcc toolkit."""

    def with_cuda(self):
        return True

    def nvcc_args(self):
        return ["-O3"]

    def incompatible_reason(self):
        torch = _torch()
        if not torch.version.cuda:
            return f"torch {torch.__version__} is built without CUDA"
        if cxx_compiler() is None:
            return f"no C++ compiler found (CXX={os.environ.get('CXX', 'c++')})"
        if cuda_home() is None:
            return "no CUDA toolkit (nvcc) found; set CUDA_HOME"
        return None


class UnsupportedOpBuilder(OpBuilder):
    """An upstream op this package does not build: never compatible, and :meth:`load` says why.

    ``REASON`` names what to use instead.
    """

    REASON = "this op is not part of this package"

    def absolute_name(self):
        return f"deepspeed.ops.{self.name}_op"

    def incompatible_reason(self):
        return self.REASON

    def is_installed(self):
        return False

    def load(self, verbose=True):
        raise NotImplementedError(f"the {self.name} op is not built by this package: {self.REASON}")

    def jit_load(self, verbose=True):
        return self.load(verbose)
