"""Confining a process that runs a stranger's program, applied by the process to itself.

The process to confine (a child started with a fresh interpreter, never forked from a process
holding keys) imports what it needs first, then calls `confine_self`, which applies, in order:

1. resource limits: no core files, no file writes (RLIMIT_FSIZE 0, which also keeps a memfd
   at size 0), `open_files` descriptors, `memory_bytes` of private writable memory
   (RLIMIT_DATA), `address_space_bytes` of mappings of any kind (RLIMIT_AS: shared ones too,
   which RLIMIT_DATA does not count) and `cpu_seconds` of CPU time, the last two as soft limits
   under an unlimited hard one, which the parent moves (`set_address_space_limit`,
   `set_cpu_limit`) and the process cannot (seccomp refuses it setrlimit);
2. no new privileges (PR_SET_NO_NEW_PRIVS), which Landlock and seccomp require;
3. no capabilities: bounding set emptied where permitted, ambient set cleared, capset to empty;
4. Landlock: every filesystem right the kernel's ABI knows is handled; `read_paths` stay
   readable (files and directories, not executable) and `device_paths` readable, writable and
   controllable (ioctl); nothing else can be opened, created, renamed, linked, truncated or
   removed. From ABI 4 no TCP bind or connect; from ABI 6 no abstract Unix sockets or signals
   outside the process. Before ABI 8 Landlock restricts only the calling thread and the threads
   started after: threads already running are counted in the report (`threads_outside`);
5. seccomp, on all threads: a raw classic-BPF filter built here with ctypes (pyseccomp and
   libseccomp were considered: no library is needed for a list this short). Default allow --
   torch's thread pools use too many calls for an allow-list to stay right -- with a foreign
   architecture (i386, arm32) killed and x32 calls refused. Refused with EPERM: new sockets of
   any family (socket, socketpair, connect, bind, listen, accept; the child keeps the socket
   pair it was given); programs (execve, execveat); processes (fork, vfork, clone without
   CLONE_THREAD or with a namespace flag; clone3 gets ENOSYS, so that glibc falls back to
   clone); other processes (ptrace, process_vm_readv/writev, process_madvise, pidfd_*, kcmp,
   tkill, migrate_pages, move_pages; kill, tgkill, rt_(tg)sigqueueinfo unless aimed at this
   process); scheduling (setpriority, sched_setparam, sched_setscheduler, sched_setattr,
   sched_setaffinity, ioprio_set: the getters stay, OpenMP reads its affinity); leaving the
   parent's session or group (setsid, setpgid) and the death signal set before confinement
   (prctl PR_SET_PDEATHSIG; prctl's other options stay: torch names its threads); System V
   IPC (shm*, msg*, sem*) and POSIX message queues (mq_*), whose memory no limit counts and
   whose objects outlive the process (POSIX shared memory is a file in /dev/shm, which
   Landlock closes); limits (setrlimit,
   and prlimit64 unless it reads this process's own: the parent's prlimit is not filtered);
   identities (set*id, setgroups); mounts and namespaces; file modes, owners, times and
   extended attributes (which Landlock does not cover); keys, bpf, perf_event_open,
   userfaultfd, io_uring; the machine (modules, kexec, reboot, swap, acct, quotactl, host
   names, fanotify, file handles, personality; modify_ldt, iopl, ioperm on x86_64); ioctl
   TIOCSTI and TIOCLINUX (typing into a terminal).

What the system lacks (another OS, another architecture, an old kernel, a container policy that
refuses Landlock or seccomp) is skipped and the `ConfinementReport` says so; a supported step
that fails raises OSError, so the process never runs less confined than it says. The CPU limit
is a backstop: a process that blocks SIGXCPU outlives it (the hard limit is unlimited), not the
parent's wall-clock timeout.
"""

from __future__ import annotations

import ctypes
import errno
import os
import pwd
import resource
import signal
import stat
import struct
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Confinement:
    """What a confined process may still do."""

    memory_bytes: int | None = None  # private writable memory, in all (RLIMIT_DATA)
    address_space_bytes: int | None = None  # every mapping, in all (soft RLIMIT_AS)
    cpu_seconds: int | None = None  # CPU seconds (soft RLIMIT_CPU): SIGXCPU ends the process
    open_files: int = 64  # RLIMIT_NOFILE: descriptors numbered below this
    read_paths: tuple[str, ...] = ()  # the only hierarchies left readable (Landlock)
    device_paths: tuple[str, ...] = ()  # device files left readable, writable, ioctl-able


@dataclass(frozen=True)
class ConfinementReport:
    """Which parts of a confinement are in force."""

    rlimits: bool
    landlock_abi: int  # 0: Landlock unavailable, files not restricted
    seccomp: bool
    capabilities_dropped: bool
    no_new_privs: bool = False
    read_rules: int = 0  # Landlock rules: readable hierarchies and files
    device_rules: int = 0  # Landlock rules: device files
    tcp_blocked: bool = False  # Landlock ABI 4+: no TCP bind or connect
    threads_outside: int = 0  # threads started before, not under Landlock

    def describe(self) -> str:
        parts = ["resource limits" if self.rlimits else "no resource limits"]
        parts.append("no new privileges" if self.no_new_privs else "new privileges possible")
        parts.append("no capabilities" if self.capabilities_dropped else "capabilities kept")
        if self.landlock_abi:
            rules = f"read-only: {_count(self.read_rules, 'path')}"
            if self.device_rules:
                rules += f", {_count(self.device_rules, 'device')}"
            rules += "; no TCP" if self.tcp_blocked else "; TCP open"
            if self.threads_outside:
                rules += f"; not on {_count(self.threads_outside, 'earlier thread')}"
            parts.append(f"Landlock ABI {self.landlock_abi} ({rules})")
        else:
            parts.append("no Landlock (files open)")
        parts.append(
            "seccomp filter (no sockets, exec, fork, ptrace)" if self.seccomp else "no seccomp"
        )
        return ", ".join(parts)


def _count(n: int, thing: str) -> str:
    return f"{n} {thing}" if n == 1 else f"{n} {thing}s"


def runtime_read_paths() -> tuple[str, ...]:
    """What an interpreter with torch reads after start-up: the standard library and
    site-packages (lazy imports), this package, the system's library folders and the dynamic
    linker's cache (dlopen), and the CPU description that torch's cpuinfo reads on the first
    operator (/sys/devices/system/cpu, /proc/cpuinfo: the machine's, no process's)."""
    paths = {sysconfig.get_path(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    # The epochmesh package root (this module lives in epochmesh/program/).
    paths.add(str(Path(__file__).resolve().parents[1]))
    paths |= {"/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib"}
    paths |= {"/etc/ld.so.cache", "/sys/devices/system/cpu", "/proc/cpuinfo"}
    return tuple(sorted(p for p in paths if p and os.path.exists(p)))


def _name_user() -> None:
    """Put the user's name in the environment while the password database can be read:
    `getpass.getuser()` reads /etc/passwd when LOGNAME and USER are unset (a child's minimal
    environment), which Landlock then refuses (torch 2.11's `torch.export.load` asks for it,
    seen on a GPU machine). A uid without a name is named by its number."""
    if any(os.environ.get(k) for k in ("LOGNAME", "USER", "LNAME", "USERNAME")):
        return
    try:
        os.environ["USER"] = pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        os.environ["USER"] = str(os.getuid())


def confine_self(c: Confinement) -> ConfinementReport:
    """Confine the calling process (irreversibly): resource limits, no new privileges, no
    capabilities, Landlock, seccomp, as far as the system supports them. OSError when a step the
    kernel supports fails."""
    _name_user()
    _set_rlimits(c)
    if not sys.platform.startswith("linux"):
        return ConfinementReport(
            rlimits=True, landlock_abi=0, seccomp=False, capabilities_dropped=False
        )
    libc = ctypes.CDLL(None, use_errno=True)
    no_new_privs = _no_new_privs(libc)
    capabilities_dropped = _drop_capabilities(libc)
    arch = _arch()  # None: no system call tables for this architecture
    landlock = _Landlock(0, 0, 0, False, 0)
    seccomp = False
    if arch is not None and no_new_privs:
        landlock = _landlock(libc, arch, c)
        seccomp = _install_seccomp(libc, arch, seccomp_program(arch, os.getpid()))
    return ConfinementReport(
        rlimits=True,
        landlock_abi=landlock.abi,
        seccomp=seccomp,
        capabilities_dropped=capabilities_dropped,
        no_new_privs=no_new_privs,
        read_rules=landlock.read_rules,
        device_rules=landlock.device_rules,
        tcp_blocked=landlock.tcp_blocked,
        threads_outside=landlock.threads_outside,
    )


def set_cpu_limit(pid: int, seconds: float) -> None:
    """Let process `pid` use at most `seconds` more CPU time (from what it has used so far): its
    soft RLIMIT_CPU, under the hard limit it has (raising that would need CAP_SYS_RESOURCE). A
    limit below what it has used sends SIGXCPU at once."""
    used = _cpu_seconds(pid)
    _, hard = resource.prlimit(pid, resource.RLIMIT_CPU)
    soft = int(used + max(1.0, seconds)) + 1
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.prlimit(pid, resource.RLIMIT_CPU, (soft, hard))


def set_address_space_limit(pid: int, limit: int) -> None:
    """Let process `pid` map at most `limit` bytes in all: its soft RLIMIT_AS, under the hard
    limit it has (see set_cpu_limit)."""
    _, hard = resource.prlimit(pid, resource.RLIMIT_AS)
    soft = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
    resource.prlimit(pid, resource.RLIMIT_AS, (soft, hard))


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def data_bytes(pid: int | None = None) -> int:
    """The private writable memory (VmData) of a process, in bytes."""
    return _status_bytes("VmData", pid)


def address_space_bytes(pid: int | None = None) -> int:
    """What a process has mapped (VmSize), in bytes."""
    return _status_bytes("VmSize", pid)


def _status_bytes(key: str, pid: int | None) -> int:
    with open(f"/proc/{pid or 'self'}/status") as f:
        for line in f:
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{key} not found")


def describe_exit(returncode: int) -> str:
    """A one-line reason for a child's exit status (Popen.returncode)."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    sig = -returncode
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    if sig == signal.SIGXCPU:
        return f"hit its CPU-time limit ({name})"
    if sig == signal.SIGSEGV:
        return f"crashed with a segmentation fault ({name})"
    return f"was killed by {name}"


# -- resource limits ---------------------------------------------------------------------------


def _set_rlimits(c: Confinement) -> None:
    limits: list[tuple[int, int]] = [
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_FSIZE, 0),
        (resource.RLIMIT_NOFILE, c.open_files),
    ]
    if c.memory_bytes is not None:
        limits.append((resource.RLIMIT_DATA, c.memory_bytes))
    for which, value in limits:
        resource.setrlimit(which, (value, value))
    # Soft only: the parent moves them (set_cpu_limit, set_address_space_limit), and could not
    # raise a hard limit.
    for which, soft_value in (
        (resource.RLIMIT_CPU, c.cpu_seconds),
        (resource.RLIMIT_AS, c.address_space_bytes),
    ):
        if soft_value is not None:
            _, hard = resource.getrlimit(which)
            soft = soft_value if hard == resource.RLIM_INFINITY else min(soft_value, hard)
            resource.setrlimit(which, (soft, hard))


# -- system calls ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    """A Linux architecture's audit number and the system calls this module uses or refuses."""

    name: str
    audit: int  # AUDIT_ARCH_*: seccomp_data.arch
    x32_bit: int  # system call numbers with this bit belong to another ABI (0: none)
    nr: dict[str, int] = field(default_factory=dict)


# The calls seccomp refuses (see the module docstring), with the calls examined by argument and
# the ones this module makes: name -> (x86_64, aarch64), None where the architecture lacks it.
_SYSCALLS: dict[str, tuple[int | None, int | None]] = {
    # sockets: no new ones of any family
    "socket": (41, 198),
    "socketpair": (53, 199),
    "connect": (42, 203),
    "bind": (49, 200),
    "listen": (50, 201),
    "accept": (43, 202),
    "accept4": (288, 242),
    # programs and processes (clone is examined, clone3 answered ENOSYS)
    "execve": (59, 221),
    "execveat": (322, 281),
    "fork": (57, None),
    "vfork": (58, None),
    "clone": (56, 220),
    "clone3": (435, 435),
    # other processes (kill and friends are examined)
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "process_madvise": (440, 440),
    "pidfd_open": (434, 434),
    "pidfd_getfd": (438, 438),
    "pidfd_send_signal": (424, 424),
    "kcmp": (312, 272),
    "tkill": (200, 130),
    "migrate_pages": (256, 238),
    "move_pages": (279, 239),
    # scheduling of any process (the agent's included: renice, SCHED_IDLE, pinning); the
    # getters (sched_getaffinity, which OpenMP reads) stay
    "setpriority": (141, 140),
    "sched_setparam": (142, 118),
    "sched_setscheduler": (144, 119),
    "sched_setaffinity": (203, 122),
    "sched_setattr": (314, 274),
    "ioprio_set": (251, 30),
    # leaving the agent's session or process group
    "setsid": (112, 157),
    "setpgid": (109, 154),
    # System V and POSIX IPC: memory no limit counts, objects that outlive the process
    "shmget": (29, 194),
    "shmat": (30, 196),
    "shmctl": (31, 195),
    "msgget": (68, 186),
    "msgsnd": (69, 189),
    "msgrcv": (70, 188),
    "msgctl": (71, 187),
    "semget": (64, 190),
    "semop": (65, 193),
    "semtimedop": (220, 192),
    "semctl": (66, 191),
    "mq_open": (240, 180),
    "mq_unlink": (241, 181),
    "mq_timedsend": (242, 182),
    "mq_timedreceive": (243, 183),
    "mq_notify": (244, 184),
    "mq_getsetattr": (245, 185),
    "kill": (62, 129),
    "tgkill": (234, 131),
    "rt_sigqueueinfo": (129, 138),
    "rt_tgsigqueueinfo": (297, 240),
    # limits: only the parent moves them, from outside (prlimit64 is examined: glibc's
    # getrlimit reads this process's limits with it)
    "setrlimit": (160, 164),
    "prlimit64": (302, 261),
    # identities
    "setuid": (105, 146),
    "setgid": (106, 144),
    "setreuid": (113, 145),
    "setregid": (114, 143),
    "setresuid": (117, 147),
    "setresgid": (119, 149),
    "setfsuid": (122, 151),
    "setfsgid": (123, 152),
    "setgroups": (116, 159),
    # mounts and namespaces
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "unshare": (272, 97),
    "setns": (308, 268),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "open_tree_attr": (467, 467),
    # file metadata, which Landlock does not cover (the user's own files, e.g. a key's mode)
    "chmod": (90, None),
    "fchmod": (91, 52),
    "fchmodat": (268, 53),
    "fchmodat2": (452, 452),
    "chown": (92, None),
    "fchown": (93, 55),
    "lchown": (94, None),
    "fchownat": (260, 54),
    "setxattr": (188, 5),
    "lsetxattr": (189, 6),
    "fsetxattr": (190, 7),
    "removexattr": (197, 14),
    "lremovexattr": (198, 15),
    "fremovexattr": (199, 16),
    "setxattrat": (463, 463),
    "removexattrat": (466, 466),
    "file_setattr": (469, 469),
    "utime": (132, None),
    "utimes": (235, None),
    "futimesat": (261, None),
    "utimensat": (280, 88),
    # kernel surface a compute process does not need
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    # the machine
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "reboot": (169, 142),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "acct": (163, 89),
    "quotactl": (179, 60),
    "quotactl_fd": (443, 443),
    "sethostname": (170, 161),
    "setdomainname": (171, 162),
    "fanotify_init": (300, 262),
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "personality": (135, 92),
    "modify_ldt": (154, None),
    "iopl": (172, None),
    "ioperm": (173, None),
    # examined or used here
    "ioctl": (16, 29),
    "prctl": (157, 167),
    "seccomp": (317, 277),
    "landlock_create_ruleset": (444, 444),
    "landlock_add_rule": (445, 445),
    "landlock_restrict_self": (446, 446),
}

# Not in the plain refusal list: examined by argument, answered ENOSYS, or made by this module.
_SPECIAL = {
    "prlimit64",
    "clone",
    "clone3",
    "kill",
    "tgkill",
    "rt_sigqueueinfo",
    "rt_tgsigqueueinfo",
    "ioctl",
    "prctl",
    "seccomp",
    "landlock_create_ruleset",
    "landlock_add_rule",
    "landlock_restrict_self",
}

ARCHES = {
    "x86_64": Arch(
        "x86_64",
        0xC000003E,
        0x40000000,
        {k: v[0] for k, v in _SYSCALLS.items() if v[0] is not None},
    ),
    "aarch64": Arch(
        "aarch64", 0xC00000B7, 0, {k: v[1] for k, v in _SYSCALLS.items() if v[1] is not None}
    ),
}


def _arch() -> Arch | None:
    if not sys.platform.startswith("linux") or struct.calcsize("P") != 8:
        return None
    return ARCHES.get(os.uname().machine)


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"confinement: {what} failed: {os.strerror(err)}")
    return result


def _syscall(libc: ctypes.CDLL, nr: int, *args: object) -> int:
    """syscall(2), integers passed as longs (syscall reads every argument as one)."""
    libc.syscall.restype = ctypes.c_long
    longs = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    return int(libc.syscall(ctypes.c_long(nr), *longs))


# -- privileges --------------------------------------------------------------------------------

_PR_SET_PDEATHSIG = 1
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


def _prctl(libc: ctypes.CDLL, option: int, arg: int = 0) -> int:
    zero = ctypes.c_ulong(0)
    return int(libc.prctl(option, ctypes.c_ulong(arg), zero, zero, zero))


def _no_new_privs(libc: ctypes.CDLL) -> bool:
    if _prctl(libc, _PR_SET_NO_NEW_PRIVS, 1) == 0:
        return True
    if ctypes.get_errno() == errno.EINVAL:  # a kernel before 3.5
        return False
    _check(-1, "prctl(PR_SET_NO_NEW_PRIVS)")
    return False


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def _drop_capabilities(libc: ctypes.CDLL) -> bool:
    """Empty the bounding set (needs CAP_SETPCAP, which a normal user lacks: then it stays, and
    no_new_privs with no exec makes it moot), the ambient set and the thread's sets."""
    for cap in range(64):
        if _prctl(libc, _PR_CAPBSET_DROP, cap) != 0:
            break  # EPERM: no CAP_SETPCAP; EINVAL: past the last capability
    if _prctl(libc, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL) != 0:
        if ctypes.get_errno() != errno.EINVAL:  # EINVAL: a kernel before 4.3
            _check(-1, "prctl(PR_CAP_AMBIENT_CLEAR_ALL)")
    header = _CapHeader(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    _check(libc.capset(ctypes.byref(header), data), "capset")
    _check(libc.capget(ctypes.byref(header), data), "capget")
    held = any(d.effective or d.permitted or d.inheritable for d in data)
    if held:
        raise OSError(errno.EPERM, "confinement: capabilities still held after capset")
    return True


# -- Landlock ----------------------------------------------------------------------------------

_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_RULE_PATH_BENEATH = 1
_LANDLOCK_RESTRICT_SELF_TSYNC = 1 << 3  # ABI 8: all threads

FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REFER = 1 << 13  # ABI 2
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5
_FS_ABI1 = (1 << 13) - 1  # execute .. make_sym
_FS_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
_NET_BIND_TCP = 1 << 0  # ABI 4
_NET_CONNECT_TCP = 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
_SCOPE_SIGNAL = 1 << 1


def landlock_fs_rights(abi: int) -> int:
    """The filesystem rights Landlock ABI `abi` knows (all of them are handled: denied but for
    the rules)."""
    rights = _FS_ABI1 if abi >= 1 else 0
    if abi >= 2:
        rights |= FS_REFER
    if abi >= 3:
        rights |= FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


@dataclass(frozen=True)
class _Landlock:
    abi: int
    read_rules: int
    device_rules: int
    tcp_blocked: bool
    threads_outside: int


def landlock_abi() -> int:
    """The running kernel's Landlock ABI version; 0 where there is none (or not Linux)."""
    arch = _arch()
    if arch is None:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    return _landlock_abi(libc, arch)


def _landlock_abi(libc: ctypes.CDLL, arch: Arch) -> int:
    nr = arch.nr["landlock_create_ruleset"]
    abi = _syscall(libc, nr, None, 0, _LANDLOCK_CREATE_RULESET_VERSION)
    if abi >= 0:
        return abi
    if ctypes.get_errno() in (errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return 0  # not built, not enabled, or refused by a container's seccomp policy
    return _check(abi, "landlock_create_ruleset(VERSION)")


def _landlock(libc: ctypes.CDLL, arch: Arch, c: Confinement) -> _Landlock:
    abi = _landlock_abi(libc, arch)
    if abi == 0:
        return _Landlock(0, 0, 0, False, 0)
    fs = landlock_fs_rights(abi)
    attr = _RulesetAttr(fs, 0, 0)
    size = 8  # ABI 1-3: handled_access_fs only; a larger struct is refused by older kernels
    if abi >= 4:
        attr.handled_access_net = _NET_BIND_TCP | _NET_CONNECT_TCP  # and no rule: no TCP
        size = 16
    if abi >= 6:
        attr.scoped = _SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL
        size = 24
    ruleset = _check(
        _syscall(libc, arch.nr["landlock_create_ruleset"], ctypes.byref(attr), size, 0),
        "landlock_create_ruleset",
    )
    try:
        reads = sum(
            _add_path_rule(libc, arch, ruleset, p, (FS_READ_FILE | FS_READ_DIR) & fs)
            for p in c.read_paths
        )
        device_rights = (FS_READ_FILE | FS_WRITE_FILE | FS_IOCTL_DEV) & fs
        devices = sum(_add_path_rule(libc, arch, ruleset, p, device_rights) for p in c.device_paths)
        threads = _thread_count()
        flags = _LANDLOCK_RESTRICT_SELF_TSYNC if abi >= 8 else 0
        _check(
            _syscall(libc, arch.nr["landlock_restrict_self"], ruleset, flags),
            "landlock_restrict_self",
        )
    finally:
        os.close(ruleset)
    outside = 0 if flags else threads - 1
    return _Landlock(abi, reads, devices, abi >= 4, outside)


def _add_path_rule(libc: ctypes.CDLL, arch: Arch, ruleset: int, path: str, rights: int) -> int:
    """Allow `rights` beneath `path` (only the file rights on a file); 0 if it does not exist."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= _FS_FILE_RIGHTS
        attr = _PathBeneathAttr(rights, fd)
        nr = arch.nr["landlock_add_rule"]
        rule = _LANDLOCK_RULE_PATH_BENEATH
        _check(_syscall(libc, nr, ruleset, rule, ctypes.byref(attr), 0), f"Landlock rule {path}")
    finally:
        os.close(fd)
    return 1


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


# -- seccomp -----------------------------------------------------------------------------------

_SECCOMP_SET_MODE_FILTER = 1
_SECCOMP_GET_ACTION_AVAIL = 2
_SECCOMP_FILTER_FLAG_TSYNC = 1
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000

_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET = 0x06  # BPF_RET | BPF_K

# struct seccomp_data: int nr; u32 arch; u64 instruction_pointer; u64 args[6]
_NR_OFFSET = 0
_ARCH_OFFSET = 4
_ARGS_OFFSET = 16

_CLONE_THREAD = 0x00010000
_CLONE_NAMESPACES = (  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
    0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
)
_TIOCSTI = 0x5412  # push input into a terminal
_TIOCLINUX = 0x541C

Instruction = tuple[int, int, int, int]  # struct sock_filter: code, jt, jf, k


def _arg_low(i: int) -> int:
    """Offset of the low 32 bits of argument i (what the kernel reads for an int argument)."""
    return _ARGS_OFFSET + 8 * i + (0 if sys.byteorder == "little" else 4)


def _arg_high(i: int) -> int:
    return _ARGS_OFFSET + 8 * i + (4 if sys.byteorder == "little" else 0)


def seccomp_program(arch: Arch, pid: int) -> list[Instruction]:
    """The seccomp filter (classic BPF) for `arch`, for the process `pid` (the only one it may
    signal): see the module docstring."""
    eperm = RET_ERRNO | errno.EPERM
    prog: list[Instruction] = [
        (_LD_W_ABS, 0, 0, _ARCH_OFFSET),
        (_JEQ, 1, 0, arch.audit),
        (_RET, 0, 0, RET_KILL_PROCESS),
        (_LD_W_ABS, 0, 0, _NR_OFFSET),
    ]
    if arch.x32_bit:
        prog += [(_JGE, 0, 1, arch.x32_bit), (_RET, 0, 0, eperm)]
    for name, nr in arch.nr.items():
        if name not in _SPECIAL:
            prog += [(_JEQ, 0, 1, nr), (_RET, 0, 0, eperm)]
    prog += [(_JEQ, 0, 1, arch.nr["clone3"]), (_RET, 0, 0, RET_ERRNO | errno.ENOSYS)]
    # clone: a thread (CLONE_THREAD) in no new namespace
    prog += [
        (_JEQ, 0, 5, arch.nr["clone"]),
        (_LD_W_ABS, 0, 0, _arg_low(0)),
        (_JSET, 0, 2, _CLONE_THREAD),
        (_JSET, 1, 0, _CLONE_NAMESPACES),
        (_RET, 0, 0, RET_ALLOW),
        (_RET, 0, 0, eperm),
    ]
    # signals: to this process only (argument 0 is the pid or thread group id)
    for name in ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        prog += [
            (_JEQ, 0, 4, arch.nr[name]),
            (_LD_W_ABS, 0, 0, _arg_low(0)),
            (_JEQ, 0, 1, pid),
            (_RET, 0, 0, RET_ALLOW),
            (_RET, 0, 0, eperm),
        ]
    # prlimit64: reading this process's limits (new limit NULL, pid 0 or its own)
    prog += [
        (_JEQ, 0, 9, arch.nr["prlimit64"]),
        (_LD_W_ABS, 0, 0, _arg_low(2)),
        (_JEQ, 0, 5, 0),
        (_LD_W_ABS, 0, 0, _arg_high(2)),
        (_JEQ, 0, 3, 0),
        (_LD_W_ABS, 0, 0, _arg_low(0)),
        (_JEQ, 2, 0, 0),
        (_JEQ, 1, 0, pid),
        (_RET, 0, 0, eperm),
        (_RET, 0, 0, RET_ALLOW),
    ]
    # ioctl: not pushing input into a terminal
    prog += [
        (_JEQ, 0, 5, arch.nr["ioctl"]),
        (_LD_W_ABS, 0, 0, _arg_low(1)),
        (_JEQ, 2, 0, _TIOCSTI),
        (_JEQ, 1, 0, _TIOCLINUX),
        (_RET, 0, 0, RET_ALLOW),
        (_RET, 0, 0, eperm),
    ]
    # prctl: the death signal stays as set before confinement (SIGKILL when the parent dies);
    # the other options (thread names, which torch sets) stay
    prog += [
        (_JEQ, 0, 3, arch.nr["prctl"]),
        (_LD_W_ABS, 0, 0, _arg_low(0)),
        (_JEQ, 0, 1, _PR_SET_PDEATHSIG),
        (_RET, 0, 0, eperm),
        (_RET, 0, 0, RET_ALLOW),
    ]
    prog.append((_RET, 0, 0, RET_ALLOW))
    return prog


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _install_seccomp(libc: ctypes.CDLL, arch: Arch, program: list[Instruction]) -> bool:
    """Install `program` on every thread of the process; False where the kernel has no seccomp
    filters (or no SECCOMP_RET_KILL_PROCESS, before 4.14) or a policy refuses them."""
    nr = arch.nr["seccomp"]
    action = ctypes.c_uint32(RET_KILL_PROCESS)
    if _syscall(libc, nr, _SECCOMP_GET_ACTION_AVAIL, 0, ctypes.byref(action)) != 0:
        if ctypes.get_errno() in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
            return False  # EPERM: refused by a container's seccomp policy
        _check(-1, "seccomp(GET_ACTION_AVAIL)")
    filters = (_SockFilter * len(program))(*(_SockFilter(*ins) for ins in program))
    fprog = _SockFprog(len(program), filters)
    result = _syscall(
        libc, nr, _SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC, ctypes.byref(fprog)
    )
    if result > 0:  # TSYNC: a thread whose filters are not ours
        raise OSError(errno.EBUSY, f"confinement: seccomp could not filter thread {result}")
    _check(result, "seccomp(SET_MODE_FILTER)")
    return True
