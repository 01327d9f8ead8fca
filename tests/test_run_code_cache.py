"""run_code's compile cache on a real directory: which failed compiles it keeps (only
those the source is to blame for) and how it counts its size."""

from __future__ import annotations

import pytest

from envhub.runcode.cache import CompileCache, Entry, key
from envhub.sandbox import StepResult

pytestmark = pytest.mark.fast


def failed(stderr: str, *, cpu_s: float | None = 0.05, exit_code: int = 1) -> Entry:
    return Entry(StepResult(exit_code=exit_code, cpu_s=cpu_s, stderr=stderr))


@pytest.mark.parametrize(
    "entry",
    [
        failed("", cpu_s=None, exit_code=70),  # the interpreter died before it answered
        failed("g++: fatal error: cannot execute 'cc1plus': Resource temporarily unavailable"),
        failed("java.lang.OutOfMemoryError: unable to create native thread"),
        failed("/bin/sh: 1: g++: not found", exit_code=127),
        failed("ld: final link failed: No space left on device"),
    ],
)
async def test_a_compile_the_machine_failed_is_not_kept(tmp_path, entry):
    cache = CompileCache(tmp_path / "cache", 1 << 20)
    digest = key("cpp", b"int main() {}", [])
    await cache.put(digest, 256, entry)
    assert await cache.get(digest, 256) is None, "the next call must compile it again"


async def test_a_compile_error_of_the_source_is_kept_for_its_memory_limit(tmp_path):
    cache = CompileCache(tmp_path / "cache", 1 << 20)
    digest = key("cpp", b"int main() { oops }", [])
    await cache.put(digest, 256, failed("main.cpp:1:14: error: 'oops' was not declared in this scope"))
    got = await cache.get(digest, 256)
    assert got is not None and got.compile.exit_code == 1 and "oops" in got.compile.stderr
    assert await cache.get(digest, 1024) is None


async def test_its_size_is_what_it_wrote(tmp_path):
    """JSON escapes make an entry larger on disk than its text: the running count must
    be the bytes written, or the cache grows past its limit between scans."""
    cache = CompileCache(tmp_path / "cache", 1 << 30)
    await cache.put(key("a", b"1", []), 256, failed(""))  # the first store measures the dir
    for i in range(3):
        await cache.put(key("a", str(i + 2).encode(), []), 256, failed('\u2018x\u2019 "y"\n' * 500))
    assert cache._size == cache._measure()
