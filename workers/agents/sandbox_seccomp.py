"""The sandbox's syscall filter: a classic BPF program for bubblewrap's ``--seccomp FD``, assembled here.

It refuses (``EPERM``) what a shell task never needs and an escape does: new namespaces (``unshare``, ``setns``,
``clone`` with a ``CLONE_NEW*`` flag), mounts (``mount``, ``umount2``, ``pivot_root``, ``chroot``, the new mount API),
other processes' memory (``ptrace``, ``process_vm_readv/writev``), the kernel's keyrings, ``bpf``,
``perf_event_open``, ``userfaultfd``, modules, ``kexec``, swap, ``reboot``, file handles, accounting and quotas.
``clone3`` answers ``ENOSYS`` (its flags are in memory a filter cannot read), so the C library falls back to ``clone``,
whose flags it can. A call from another ABI than the host's (32-bit ``int 0x80`` on x86-64, x32) is refused too, so
that the table cannot be bypassed with another numbering. Written for x86-64 and aarch64; elsewhere
:func:`seccomp_program` raises.

>>> len(seccomp_program("x86_64")) % 8  # struct sock_filter entries of 8 bytes each
0
"""

from __future__ import annotations

import errno
import platform
import struct

# linux/filter.h: instruction classes and fields
_BPF_LD, _BPF_JMP, _BPF_RET = 0x00, 0x05, 0x06
_BPF_W, _BPF_ABS, _BPF_K = 0x00, 0x20, 0x00
_BPF_JEQ, _BPF_JGE, _BPF_JSET = 0x10, 0x30, 0x40
# linux/seccomp.h
_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6] (args[0]'s low word on LE)
_OFFSET_NR, _OFFSET_ARCH, _OFFSET_ARG0_LOW = 0, 4, 16
#: CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET
CLONE_NEW_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

#: the calls used, by number, per machine (asm/unistd_64.h and asm-generic/unistd.h)
_X86_64 = (
    "clone=56 clone3=435 unshare=272 setns=308 mount=165 umount2=166 pivot_root=155 chroot=161 ptrace=101 "
    "process_vm_readv=310 process_vm_writev=311 keyctl=250 add_key=248 request_key=249 bpf=321 "
    "perf_event_open=298 userfaultfd=323 kexec_load=246 kexec_file_load=320 init_module=175 "
    "finit_module=313 delete_module=176 open_by_handle_at=304 name_to_handle_at=303 swapon=167 "
    "swapoff=168 reboot=169 acct=163 quotactl=179 syslog=103 open_tree=428 move_mount=429 fsopen=430 "
    "fsconfig=431 fsmount=432 fspick=433 mount_setattr=442 "
)
_AARCH64 = (
    "clone=220 clone3=435 unshare=97 setns=268 mount=40 umount2=39 pivot_root=41 chroot=51 ptrace=117 "
    "process_vm_readv=270 process_vm_writev=271 keyctl=219 add_key=217 request_key=218 bpf=280 "
    "perf_event_open=241 userfaultfd=282 kexec_load=104 kexec_file_load=294 init_module=105 "
    "finit_module=273 delete_module=106 open_by_handle_at=265 name_to_handle_at=264 swapon=224 "
    "swapoff=225 reboot=142 acct=89 quotactl=60 syslog=116 open_tree=428 move_mount=429 fsopen=430 "
    "fsconfig=431 fsmount=432 fspick=433 mount_setattr=442 "
)
#: per machine: (AUDIT_ARCH value, the lowest syscall number of a foreign sub-ABI or None, numbers of the calls used)
_ARCHES: dict[str, tuple[int, int | None, dict[str, int]]] = {
    # AUDIT_ARCH_X86_64; __X32_SYSCALL_BIT: x32 calls share the arch value and set this bit
    "x86_64": (0xC000003E, 0x40000000, {k: int(v) for k, _, v in (w.partition("=") for w in _X86_64.split())}),
    # AUDIT_ARCH_AARCH64
    "aarch64": (0xC00000B7, None, {k: int(v) for k, _, v in (w.partition("=") for w in _AARCH64.split())}),
}
#: refused with EPERM, whatever their arguments
REFUSED = tuple(name for name in _ARCHES["x86_64"][2] if name not in ("clone", "clone3"))


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def seccomp_program(machine: str | None = None) -> bytes:
    """The filter for ``machine`` (default: this one's ``platform.machine()``), as bwrap reads it from a file.

    Raises:
        OSError: no table for this machine (the sandbox refuses to run unfiltered).
    """
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        raise OSError(f"no seccomp filter for machine {machine!r}: expected one of {sorted(_ARCHES)}")
    arch, foreign_bit, numbers = _ARCHES[machine]
    refused = [numbers[name] for name in REFUSED]
    # Layout (jumps count instructions forward from the next one):
    #   ld arch; jeq ARCH ? next : DENY;  ld nr;  [jge FOREIGN ? DENY : next];
    #   jeq N ? DENY : next  (each refused N);  jeq clone3 ? ENOSYS : next;  jeq clone ? next : ALLOW;
    #   ld args[0]; jset CLONE_NEW* ? DENY : ALLOW;  ALLOW: ret allow;  ENOSYS: ret errno;  DENY: ret errno
    body: list[tuple[int, int, str | None, str | None]] = [(_BPF_LD | _BPF_W | _BPF_ABS, _OFFSET_ARCH, None, None)]
    body.append((_BPF_JMP | _BPF_JEQ | _BPF_K, arch, None, "deny"))
    body.append((_BPF_LD | _BPF_W | _BPF_ABS, _OFFSET_NR, None, None))
    if foreign_bit is not None:
        body.append((_BPF_JMP | _BPF_JGE | _BPF_K, foreign_bit, "deny", None))
    body += [(_BPF_JMP | _BPF_JEQ | _BPF_K, number, "deny", None) for number in refused]
    body.append((_BPF_JMP | _BPF_JEQ | _BPF_K, numbers["clone3"], "enosys", None))
    body.append((_BPF_JMP | _BPF_JEQ | _BPF_K, numbers["clone"], None, "allow"))
    body.append((_BPF_LD | _BPF_W | _BPF_ABS, _OFFSET_ARG0_LOW, None, None))
    body.append((_BPF_JMP | _BPF_JSET | _BPF_K, CLONE_NEW_FLAGS, "deny", "allow"))
    targets = {"allow": len(body), "enosys": len(body) + 1, "deny": len(body) + 2}
    program = bytearray()
    for index, (code, k, true, false) in enumerate(body):
        jt = targets[true] - index - 1 if true else 0
        jf = targets[false] - index - 1 if false else 0
        assert 0 <= jt < 256 and 0 <= jf < 256, "a jump beyond classic BPF's 8-bit offsets"
        program += _insn(code, k, jt, jf)
    program += _insn(_BPF_RET | _BPF_K, _RET_ALLOW)
    program += _insn(_BPF_RET | _BPF_K, _RET_ERRNO | errno.ENOSYS)
    program += _insn(_BPF_RET | _BPF_K, _RET_ERRNO | errno.EPERM)
    return bytes(program)
