"""The sandbox's seccomp filter, run through a small classic-BPF interpreter: what each architecture's program answers
for the calls it refuses, for clone's namespace flags, for another ABI and for an ordinary call. (That the kernel
applies it inside bubblewrap is checked in test_sandbox.py.)"""

from __future__ import annotations

import errno
import struct

import pytest

from workers.agents.sandbox_seccomp import _ARCHES, CLONE_NEW_FLAGS, REFUSED, seccomp_program

ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | errno.EPERM, 0x00050000 | errno.ENOSYS
AUDIT_ARCH_I386 = 0x40000003


def run(program: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """What ``program`` returns for ``struct seccomp_data`` (nr, arch, ip 0, args[0] = arg0)."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
    insns = [struct.unpack_from("=HBBI", program, offset) for offset in range(0, len(program), 8)]
    pc, accumulator = 0, 0
    while True:
        code, jt, jf, k = insns[pc]
        if code == 0x20:  # ld [k]
            accumulator = struct.unpack_from("=I", data, k)[0]
        elif code == 0x06:  # ret k
            return k
        elif code & 0x07 == 0x05:  # jmp
            operation = code & 0xF0
            taken = {0x10: accumulator == k, 0x30: accumulator >= k, 0x40: accumulator & k != 0}[operation]
            pc += jt if taken else jf
        else:
            raise AssertionError(f"unexpected instruction {code:#x}")
        pc += 1


@pytest.mark.parametrize("machine", sorted(_ARCHES))
def test_each_refused_call_answers_eperm_and_ordinary_calls_pass(machine: str) -> None:
    program = seccomp_program(machine)
    arch, _, numbers = _ARCHES[machine]
    assert len(program) % 8 == 0
    for name in REFUSED:
        assert run(program, numbers[name], arch) == EPERM, name
    refused = set(numbers.values()) - {numbers["clone"], numbers["clone3"]}
    ordinary = [nr for nr in range(400) if nr not in refused]  # read, write, openat, execve, wait4...
    assert {run(program, nr, arch) for nr in ordinary if nr != numbers["clone"]} == {ALLOW}
    assert run(program, numbers["clone3"], arch) == ENOSYS  # so that libc falls back to clone
    assert run(program, numbers["clone"], arch, arg0=0x01200011) == ALLOW  # fork(): SIGCHLD | CLONE_CHILD_*TID
    for flag in (1 << bit for bit in range(32)):
        if flag & CLONE_NEW_FLAGS:
            assert run(program, numbers["clone"], arch, arg0=flag | 0x11) == EPERM, hex(flag)


def test_another_abi_is_refused_whatever_the_call() -> None:
    program = seccomp_program("x86_64")
    assert run(program, 0, AUDIT_ARCH_I386) == EPERM  # int 0x80: i386 numbering
    assert run(program, 0x40000000 | 272, _ARCHES["x86_64"][0]) == EPERM  # x32 unshare
    assert run(seccomp_program("aarch64"), 97, _ARCHES["x86_64"][0]) == EPERM


def test_a_machine_without_a_table_is_refused() -> None:
    with pytest.raises(
        OSError, match=r"no seccomp filter for machine 'riscv64': expected one of \['aarch64', 'x86_64'\]"
    ):
        seccomp_program("riscv64")
