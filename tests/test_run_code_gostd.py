"""/run_code's Go on a toolchain that ships no compiled standard library (Go 1.20 and
later): the node compiles it once, and each call's ``go build`` reads it instead of
compiling ``fmt`` and the runtime again (envhub/runcode/gostd.py).

The Go is Debian's golang-1.23-go from bookworm-backports, which scripts/setup-test-tools.sh
installs into /usr/lib/go-1.23 beside the default (bookworm's 1.19, which ships it
compiled). The node's Go command adds ``-x``, so a compile's stderr names every package
it compiled: the test reads what each call compiled from there.
"""

from __future__ import annotations

import glob
import os
import stat

import httpx
import pytest
from conftest import EnvhubProcess, eventually

from envhub.plugins.process_sandbox.workdirs import default_work_root

GO = "/usr/lib/go-1.23/bin/go"
SUM = 'package main\nimport "fmt"\nfunc main() { var a, b int; fmt.Scan(&a, &b); fmt.Println(a + b) }\n'
# text/tabwriter is not among the packages the node compiles: a call compiles it itself.
TABS = (
    'package main\nimport (\n"fmt"\n"os"\n"text/tabwriter"\n)\n'
    "func main() { w := tabwriter.NewWriter(os.Stdout, 0, 4, 1, ' ', 0); fmt.Fprintln(w, \"a\\tb\"); w.Flush() }\n"
)
# Given the cache's path on stdin, try to change it every way a file can be changed.
POISON = """package main
import ("bufio"; "fmt"; "os"; "path/filepath")
func main() {
	dir, _ := bufio.NewReader(os.Stdin).ReadString('\\n')
	dir = dir[:len(dir)-1]
	fmt.Println("new", os.WriteFile(filepath.Join(dir, "poison"), []byte("x"), 0o644) != nil)
	fmt.Println("chmod", os.Chmod(dir, 0o777) != nil)
	entries, _ := filepath.Glob(filepath.Join(dir, "*", "*-d"))
	f, err := os.OpenFile(entries[0], os.O_WRONLY, 0)
	if err == nil { f.Close() }
	fmt.Println("write", len(entries) > 0 && err != nil)
	fmt.Println("remove", os.Remove(entries[0]) != nil)
}
"""

pytestmark = pytest.mark.skipif(
    not os.path.exists(GO) and not os.environ.get("CI"), reason=f"no {GO} (scripts/setup-test-tools.sh installs it)"
)


def go_node(data, uid_base: int, *, trace: bool = False) -> EnvhubProcess:
    """A started node whose Go is Go 1.23 (with ``trace``, its build says what it compiles)."""
    build = f"[{GO}, build{', -x' if trace else ''}, -o, main, main.go]"
    return EnvhubProcess(
        data,
        "--set", "environments.terminal-bench.enabled=false",
        "--set", f"run_code.languages.go.compile={build}",
        "--set", f"run_code.sandbox.uid_base={uid_base}",
    ).start()  # fmt: skip


def compiled_packages(reply: dict) -> set[str]:
    """The packages a compile's ``go build -x`` says it compiled (``compile ... -p <pkg>``)."""
    out = set()
    for line in reply["compile_result"]["stderr"].splitlines():
        words = line.split()
        if words and words[0].endswith("/compile") and "-p" in words:
            out.add(words[words.index("-p") + 1])
    return out


def test_go_calls_read_a_standard_library_the_node_compiled_once(tmp_path):
    assert os.geteuid() == 0, "the cache is used where sandboxes run as uids of their own (root)"
    data = tmp_path / "data"
    node = go_node(data, 3700000, trace=True)
    try:
        with node.client(timeout=300) as c:
            first = c.post("/run_code", json={"language": "go", "code": SUM, "stdin": "2 3", "compile_timeout": 120})
            assert first.status_code == 200, first.text
            reply = first.json()
            assert reply["status"] == "Success" and reply["run_result"]["stdout"] == "5\n", reply
            assert compiled_packages(reply) == {"main"}, "fmt and the runtime came from the node's cache"

            tabs = c.post("/run_code", json={"language": "go", "code": TABS, "compile_timeout": 120}).json()
            assert tabs["status"] == "Success" and tabs["run_result"]["stdout"] == "a b\n", tabs
            assert compiled_packages(tabs) == {"main", "text/tabwriter"}, "what the node did not compile, a call does"

            work_root, _ = default_work_root(data, "run-code")
            (cache,) = glob.glob(os.path.join(work_root, ".go-std-*"))
            st = os.stat(cache)
            assert st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o555
            poison = c.post(
                "/run_code", json={"language": "go", "code": POISON, "stdin": cache + "\n", "compile_timeout": 120}
            ).json()
            assert poison["status"] == "Success", poison
            assert poison["run_result"]["stdout"].split() == [
                "new", "true", "chmod", "true", "write", "true", "remove", "true",
            ], poison  # fmt: skip
            assert not os.path.exists(os.path.join(cache, "poison"))
        assert "Go's standard library compiled for Go calls" in node.log()
    finally:
        assert node.stop() == 0, node.log()
    assert not glob.glob(os.path.join(work_root, ".go-std-*")), "the copy goes with the sandbox"
    kept = glob.glob(str(data / "run-code-go-std" / "*" / "envhub-ready"))
    assert len(kept) == 1, "the built cache stays in the data dir for the next start"


def test_a_node_restarted_copies_the_cache_it_built_instead_of_compiling_again(tmp_path):
    for start in range(2):
        node = go_node(tmp_path / "data", 3710000, trace=True)
        try:
            reply = httpx.post(
                f"{node.url}/run_code",
                json={"language": "go", "code": SUM, "stdin": "4 5", "compile_timeout": 120},
                timeout=300,
            ).json()
            assert reply["run_result"]["stdout"] == "9\n" and compiled_packages(reply) == {"main"}, reply
        finally:
            assert node.stop() == 0, node.log()
        built = node.log().count("Go's standard library compiled for Go calls")
        assert built == (1 if start == 0 else 0), node.log()


def test_a_node_stopped_while_it_compiles_the_library_ends_the_compile(tmp_path):
    """SIGTERM during the build at a first start: the node stops its compiler, keeps no
    half-built cache and leaves no temp dir (the next start builds it again)."""
    data = tmp_path / "data"
    node = go_node(data, 3730000)
    store = data / "run-code-go-std"
    try:
        assert eventually(lambda: any(store.glob(".*")), timeout=10, message="the build never began")
    finally:
        assert node.stop() == 0, node.log()
    assert list(store.iterdir()) == [], "no cache kept, no temp dir left"
    assert "Go's standard library compiled" not in node.log() and "did not compile" not in node.log()
