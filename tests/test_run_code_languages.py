"""Which languages run_code is told to offer (``run_code.languages`` and
``run_code.extra_languages``), read from config alone: what each form gives and the
startup error each bad one is. That a configured language runs is test_run_code.py's."""

from __future__ import annotations

import pytest

from envhub.errors import StartupError
from envhub.runcode.languages import BUILTIN, configured

pytestmark = pytest.mark.fast

D_UT = {
    "source": "main.d",
    "compile": ["ldmd2", "main.d", "-unittest", "-of=main"],
    "artifact": "main",
    "run": ["./main"],
}


def test_absent_is_every_built_in_language():
    assert configured({}) == BUILTIN


def test_a_list_narrows_and_a_mapping_is_exactly_what_it_names():
    assert list(configured({"languages": ["python", "cpp"]})) == ["python", "cpp"]
    only_go = configured({"languages": {"go": {"compile": ["/opt/go/bin/go", "build", "-o", "main", "main.go"]}}})
    assert list(only_go) == ["go"] and only_go["go"].compile[0] == "/opt/go/bin/go"
    assert only_go["go"].run == BUILTIN["go"].run and only_go["go"].env == BUILTIN["go"].env


def test_extra_languages_add_to_the_built_in_ones_and_change_them_in_place():
    langs = configured(
        {"extra_languages": {"D_ut": D_UT, "cpp": {"compile": ["g++", "-std=c++20", "main.cpp", "-o", "main"]}}}
    )
    assert set(langs) == {*BUILTIN, "D_ut"}
    d = langs["D_ut"]
    assert (d.name, d.source, d.compile, d.artifact, d.run) == (
        "D_ut",
        "main.d",
        tuple(D_UT["compile"]),
        "main",
        ("./main",),
    )
    assert d.compiled and not d.takes_args and d.limit_run
    assert langs["cpp"].compile == ("g++", "-std=c++20", "main.cpp", "-o", "main")
    assert langs["cpp"].artifact == "main" and langs["cpp"].run == ("./main",), "what it did not name stays"
    assert langs["python"] == BUILTIN["python"]


def test_extra_languages_add_to_a_narrowed_list_too():
    langs = configured(
        {
            "languages": ["python"],
            "extra_languages": {"racket": {"source": "main.rkt", "run": ["racket", "main.rkt"]}, "cpp": None},
        }
    )
    assert list(langs) == ["python", "racket", "cpp"] and langs["cpp"] == BUILTIN["cpp"]


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"languages": ["python", "D_ut"]}, "run_code.languages names D_ut, which envhub has no commands for"),
        ({"languages": "python"}, "run_code.languages must be a list of names or a mapping"),
        ({"extra_languages": ["D_ut"]}, "run_code.extra_languages must be a mapping"),
        ({"extra_languages": {"D_ut": ["ldmd2"]}}, "run_code.extra_languages.D_ut must be a mapping of changes"),
        ({"languages": {"go": "go build"}}, "run_code.languages.go must be a mapping of changes"),
        (
            {"extra_languages": {"D_ut": {"source": "main.d"}}},
            "run_code.extra_languages.D_ut is not built in, so it needs source and run",
        ),
        (
            {"extra_languages": {"D_ut": {**D_UT, "artifact": None}}},
            "run_code.extra_languages.D_ut compiles, so it needs the artifact",
        ),
        (
            {"extra_languages": {"D_ut": {**D_UT, "run": "./main"}}},
            "run_code.extra_languages.D_ut.run must be a command",
        ),
        ({"extra_languages": {"D_ut": {**D_UT, "run": None}}}, "run_code.extra_languages.D_ut.run cannot be empty"),
        ({"languages": {"bash": {"source": None}}}, "run_code.languages.bash.source must name the file"),
        (
            {"extra_languages": {"D_ut": {**D_UT, "source": ""}}},
            "run_code.extra_languages.D_ut.source must name the file",
        ),
        (
            {"extra_languages": {"pytest": {"takes_args": "yes"}}},
            "run_code.extra_languages.pytest.takes_args must be true or false",
        ),
        ({"extra_languages": {"bash": {"env": ["A=1"]}}}, "run_code.extra_languages.bash.env must be a mapping"),
        ({"extra_languages": {"bash": {"shell": "sh"}}}, "run_code.extra_languages.bash has an unknown key 'shell'"),
    ],
)
def test_a_bad_language_config_is_a_startup_error_naming_its_key(config, says):
    with pytest.raises(StartupError) as e:
        configured(config)
    assert says in str(e.value)
