"""The kernel's confinement of a grader's child, applied by the child to itself before it reads any
user code: Landlock (a filesystem view of its working directory, read-write, and the Python
installation and system libraries, read-only; no TCP; no signals or abstract sockets out of its
domain), a seccomp filter (no new process beyond its own threads, no ``exec``, no socket, no
``ptrace``, no ``mount`` or namespace, no kernel keyring, no ``bpf``, ``userfaultfd``,
``memfd_create`` or ``io_uring``, no signal or scheduling change to another process), no new
privileges, and no capability.

The standard library only (``ctypes``; libseccomp 2.5+, ``libseccomp.so.2``, for the filter), so
the child can load it by path: ``engine.graders.python_child`` imports nothing of the engine. The
parent (``engine.graders.sandbox``) uses the same probes to say what this box gives.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterable

PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP = 24
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
LINUX_CAPABILITY_VERSION_3 = 0x20080522

# Landlock (include/uapi/linux/landlock.h): the same system call numbers on every architecture
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REMOVE_DIR, FS_REMOVE_FILE, FS_MAKE_CHAR, FS_MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
FS_MAKE_REG, FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK = 1 << 8, 1 << 9, 1 << 10, 1 << 11
FS_MAKE_SYM, FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 12, 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
# the filesystem rights each Landlock ABI version knows (a ruleset may only name those)
FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}
READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
# in its own folder: files and folders, never a device node, socket, FIFO or link
WORK = FS_READ_FILE | FS_READ_DIR | FS_WRITE_FILE | FS_REMOVE_DIR | FS_REMOVE_FILE | FS_MAKE_DIR | FS_MAKE_REG
WORK_V3 = FS_TRUNCATE
# where dynamic libraries come from when an extension module is loaded after the restriction
SYSTEM_LIBRARIES = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/etc/ld.so.cache")

# seccomp (libseccomp's scmp_compare and actions)
SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_CMP_NE, SCMP_CMP_EQ, SCMP_CMP_MASKED_EQ = 1, 4, 7
CLONE_THREAD = 0x00010000
TIOCSTI, TIOCLINUX = 0x5412, 0x541C
# refused outright (EPERM): processes, other processes' memory and signals, mounts and
# namespaces, keyrings, the kernel's own machinery, file handles that skip the path walk, nodes
DENIED = (
    "fork", "vfork", "execve", "execveat",
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp",
    "pidfd_open", "pidfd_getfd", "pidfd_send_signal", "tkill",
    "mount", "umount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
    "fsconfig", "fsmount", "fspick", "mount_setattr", "unshare", "setns",
    "add_key", "request_key", "keyctl",
    "bpf", "userfaultfd", "perf_event_open", "memfd_create", "memfd_secret",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module", "reboot",
    "swapon", "swapoff", "acct", "quotactl", "quotactl_fd", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "syslog", "vhangup", "iopl", "ioperm", "lookup_dcookie",
    "open_by_handle_at", "name_to_handle_at", "mknod", "mknodat", "sethostname", "setdomainname",
    "uselib", "fanotify_init", "setpriority", "ioprio_set", "migrate_pages", "move_pages",
    "socket", "connect", "bind", "listen", "accept", "accept4",
)  # fmt: skip
# allowed only on the calling process itself: argument 0 is 0 (these calls' "myself")
SELF_ZERO = ("sched_setaffinity", "sched_setscheduler", "sched_setparam", "sched_setattr", "prlimit64")
# allowed only on the calling process itself: argument 0 is its process id
SELF_PID = ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")


class ConfineError(OSError):
    """A layer could not be applied; the child stops before it reads user code."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _call(result: int, what: str) -> int:
    if result < 0:
        code = ctypes.get_errno()
        raise ConfineError(code, f"{what}: {os.strerror(code)}")
    return result


def landlock_abi() -> int:
    """The Landlock ABI version this kernel offers; 0 without Landlock."""
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    version = libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                           ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))  # fmt: skip
    return max(int(version), 0)


def _seccomp_library() -> ctypes.CDLL | None:
    for name in ("libseccomp.so.2", "libseccomp.so"):
        try:
            library = ctypes.CDLL(name, use_errno=True)
        except OSError:
            continue
        if hasattr(library, "seccomp_init") and hasattr(library, "seccomp_rule_add_array"):
            return library
    return None


def seccomp_available() -> bool:
    """Whether libseccomp loads and this kernel filters system calls (``/proc/self/status`` says
    ``Seccomp:``)."""
    if _seccomp_library() is None:
        return False
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as status:
            return any(line.startswith("Seccomp:") for line in status)
    except OSError:
        return False


def no_new_privileges() -> None:
    """``PR_SET_NO_NEW_PRIVS``: no exec may gain privileges (set-user-ID files, file capabilities)."""
    _call(_libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


def drop_capabilities() -> None:
    """Give up every capability (a child of a service run as root has them all): the bounding and
    ambient sets, then the effective, permitted and inheritable ones."""
    libc = _libc()
    try:
        with open("/proc/sys/kernel/cap_last_cap", encoding="ascii") as last_file:
            last = int(last_file.read())
    except (OSError, ValueError):
        last = 63
    for cap in range(last + 1):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0 and ctypes.get_errno() not in (
            errno.EINVAL,
            errno.EPERM,
        ):
            _call(-1, f"prctl(PR_CAPBSET_DROP, {cap})")
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)  # EINVAL on kernels without it
    header = _CapHeader(LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _call(libc.capset(ctypes.byref(header), data), "capset")


class _RulesetAttr(ctypes.Structure):
    _fields_ = (("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64))  # fmt: skip


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


def restrict_filesystem(abi: int, readable: Iterable[str], writable: Iterable[str]) -> None:
    """Landlock this process: it may read (and map) files under ``readable``, read and write under
    ``writable``, and nothing else; no TCP bind or connect (ABI 4+); no signal to and no abstract
    Unix socket of a process outside this domain (ABI 6+). Needs ``no_new_privileges`` first."""
    handled = FS_BY_ABI[max(v for v in FS_BY_ABI if v <= abi)]
    attr = _RulesetAttr(handled, 0, 0)
    size = 8
    if abi >= 4:
        attr.handled_access_net, size = NET_BIND_TCP | NET_CONNECT_TCP, 16
    if abi >= 6:
        attr.scoped, size = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL, 24
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    ruleset = _call(
        libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), ctypes.byref(attr), ctypes.c_size_t(size),
                     ctypes.c_uint32(0)),
        "landlock_create_ruleset",
    )  # fmt: skip
    try:
        work = WORK | (WORK_V3 if abi >= 3 else 0)
        rules = [(path, READ) for path in readable] + [(path, work) for path in writable]
        for path, access in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not on this box (say /lib64)
            try:
                if not os.path.isdir(path):
                    access &= FS_EXECUTE | FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE
                rule = _PathBeneath(access & handled, fd)
                kind = ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH)
                added = libc.syscall(
                    ctypes.c_long(SYS_LANDLOCK_ADD_RULE),
                    ctypes.c_int(ruleset),
                    kind,
                    ctypes.byref(rule),
                    ctypes.c_uint32(0),
                )
                _call(added, f"landlock_add_rule({path})")
            finally:
                os.close(fd)
        _call(
            libc.syscall(
                ctypes.c_long(SYS_LANDLOCK_RESTRICT_SELF), ctypes.c_int(ruleset), ctypes.c_uint32(0)
            ),
            "landlock_restrict_self",
        )
    finally:
        os.close(ruleset)


class _ArgCmp(ctypes.Structure):
    _fields_ = (
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    )


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


def filter_system_calls(pid: int) -> None:
    """Load the seccomp filter (see the module's docstring); every refusal is an ``EPERM`` the
    caller sees as ``PermissionError``, except ``clone3``'s ``ENOSYS``, so that the C library
    makes threads with ``clone``, whose flags the filter can read. Needs ``no_new_privileges``."""
    library = _seccomp_library()
    if library is None:
        raise ConfineError(errno.ENOSYS, "libseccomp (libseccomp.so.2) is not installed")
    library.seccomp_init.restype = ctypes.c_void_p
    library.seccomp_syscall_resolve_name.argtypes = (ctypes.c_char_p,)
    library.seccomp_rule_add_array.argtypes = (
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.c_void_p,
    )
    library.seccomp_load.argtypes = (ctypes.c_void_p,)
    library.seccomp_release.argtypes = (ctypes.c_void_p,)
    context = library.seccomp_init(SCMP_ACT_ALLOW)
    if not context:
        raise ConfineError(errno.ENOMEM, "seccomp_init failed")
    deny = _errno_action(errno.EPERM)

    def rule(action: int, name: str, *comparisons: tuple[int, int, int, int]) -> None:
        number = library.seccomp_syscall_resolve_name(name.encode())
        if number < 0:  # __NR_SCMP_ERROR: not a system call of this architecture
            return
        array = (_ArgCmp * max(len(comparisons), 1))(*(_ArgCmp(*c) for c in comparisons))
        result = library.seccomp_rule_add_array(context, action, number, len(comparisons), array)
        if result < 0 and result != -errno.EDOM:
            raise ConfineError(-result, f"seccomp_rule_add({name}): {os.strerror(-result)}")

    try:
        for name in DENIED:
            rule(deny, name)
        rule(_errno_action(errno.ENOSYS), "clone3")
        rule(deny, "clone", (0, SCMP_CMP_MASKED_EQ, CLONE_THREAD, 0))  # a process, not a thread
        for name in SELF_ZERO:
            rule(deny, name, (0, SCMP_CMP_NE, 0, 0))
        for name in SELF_PID:
            rule(deny, name, (0, SCMP_CMP_NE, pid, 0))
        for request in (TIOCSTI, TIOCLINUX):
            rule(deny, "ioctl", (1, SCMP_CMP_EQ, request, 0))
        result = library.seccomp_load(context)
        if result < 0:
            raise ConfineError(-result, f"seccomp_load: {os.strerror(-result)}")
    finally:
        library.seccomp_release(context)
