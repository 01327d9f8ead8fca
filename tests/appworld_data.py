"""A small synthetic AppWorld data set, built at test time from the pip-installed package.

AppWorld's official data cannot be downloaded here, and files generated from its app code
(base DBs, API docs) must never be committed: that code is licensed for encrypted
redistribution only. So the tests build their own data with AppWorld's own machinery
(its models, ``ModelCollection``, ``save_local_dbs``), adapted from
``../shared/appworld/build_synthetic.py``: one base world (a supervisor with SimpleNote,
Venmo and phone accounts, notes, contacts) and seven tasks across the four splits, graded
by ``evaluation.py`` files of the official format:

- ``synth001_1``  a question (the pinned note's title); no change allowed
- ``synth002_1``  create one note; a wrong title fails one requirement of three
- ``synth003_1``  two apps: find my sister in the phone's contacts, pay her on Venmo
- ``synth004_1``  many steps: delete each of 12 archived notes, paging through them
- ``synth005_1``  (dev) a count over pages
- ``synth006_1``  (test_normal) a phone number from the contacts
- ``synth007_1``  (test_challenge) pay both siblings on Venmo

This file is used two ways. Imported by the tests (standard library only): ``PYTHON`` is
the AppWorld venv scripts/test makes (``envhub appworld setup --dir .appworld``), and
:func:`synthetic_root` builds the data once (cached under ``.appworld/`` by a hash of this
file) and returns its root. Run by that venv's python as ``appworld_data.py build ROOT``,
it builds. ``python tests/appworld_data.py`` fills the cache (scripts/test does it beside
its other setup).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from textwrap import dedent, indent

REPO = Path(__file__).resolve().parents[1]
AW_DIR = REPO / ".appworld"
PYTHON = AW_DIR / "venv" / "bin" / "python"

SUPERVISOR = {
    "first_name": "Alex",
    "last_name": "Doe",
    "email": "alex.doe@example.com",
    "phone_number": "5551234567",
}
PASSWORDS = {"simple_note": "notepass123", "venmo": "venmopass123", "phone": "phonepass123"}
SIBLINGS = {
    "sister": {"first_name": "Jamie", "last_name": "Doe", "email": "jamie.doe@example.com", "phone": "5559870001"},
    "brother": {"first_name": "Sam", "last_name": "Doe", "email": "sam.doe@example.com", "phone": "5559870002"},
}
FRIEND = {"first_name": "Pat", "last_name": "Lee", "email": "pat.lee@example.com", "phone": "5559870003"}
NOTES = [("Trip ideas", "Lisbon, Kyoto, Reykjavik", ["personal"], True)]
NOTES += [
    ("Book list", "Dune; Emma; Ulysses", ["personal"], False),
    ("Gym plan", "Mon legs, Wed back", ["health"], False),
]
ARCHIVED = [f"Old receipt {n}" for n in range(1, 13)]
NOTES += [(title, "paid", ["archive"], False) for title in ARCHIVED]


def _evaluation(*parts: str) -> str:
    header = '''
        import json

        from appworld.evaluator import TestTracker


        def evaluate(test: TestTracker, public_data, private_data, main_user, models, ground_truth_answer) -> None:
            active_tasks = models.end.supervisor.Task.all()
            try:
                predicted_answer = json.loads(active_tasks[0].answer)
            except json.JSONDecodeError:
                predicted_answer = active_tasks[0].answer
            test.task_completed = active_tasks[0].status == "success"
            with test("""
                assert answers match.
                """):
                test.answer(predicted_answer, ground_truth_answer)
        '''
    body = "\n".join(dedent(part).strip("\n") for part in parts)
    return dedent(header) + indent(body, "    ") + "\n"


_NO_CHANGES = '''
    with test("""
        assert no model changes.
        """):
        test.case(models.changed_model_names(), "==", set())
'''
_VENMO_CHANGES = '''
    with test("""
        assert model changes match venmo.Transaction, venmo.User, venmo.Notification.
        """):
        test.case(models.changed_model_names(), "==", {"venmo.Transaction", "venmo.User", "venmo.Notification"})
'''


def _task(split, instruction, answer, body, requirements, private=None):
    parts = body if isinstance(body, tuple) else (body,)
    return {
        "split": split,
        "instruction": instruction,
        "answer": answer,
        "evaluation": _evaluation(*parts),
        "private_data": private or {},
        "test_data": [{"requirement": "assert answers match.", "label": "no_op_fail"}]
        + [{"requirement": r, "label": "no_op_fail"} for r in requirements],
    }


TASKS = {
    "synth001_1": _task(
        "train",
        "What is the title of my pinned note in SimpleNote?",
        "Trip ideas",
        _NO_CHANGES,
        ["assert no model changes."],
    ),
    "synth002_1": _task(
        "train",
        "Create a note in SimpleNote titled 'Groceries' with the content 'milk, eggs'.",
        None,
        '''
        with test("""
            assert model changes match simple_note.Note.
            """):
            test.case(models.changed_model_names(), "==", {"simple_note.Note"})
        with test("""
            assert exactly one note titled Groceries with content 'milk, eggs' was added.
            """):
            added, updated, removed = models.changed_records("simple_note.Note")
            test.case(len(added), "==", 1)
            test.case(added[0].title, "==", private_data.title, normalize_text=True)
            test.case(added[0].content, "==", private_data.content, normalize_text=True)
        ''',
        [
            "assert model changes match simple_note.Note.",
            "assert exactly one note titled Groceries with content 'milk, eggs' was added.",
        ],
        {"title": "Groceries", "content": "milk, eggs"},
    ),
    "synth003_1": _task(
        "train",
        "Send $25 on Venmo to my sister for the concert tickets.",
        None,
        (
            _VENMO_CHANGES,
            '''
        with test("""
            assert exactly one payment of 25 went to my sister.
            """):
            added, updated, removed = models.changed_records("venmo.Transaction")
            test.case(len(added), "==", 1)
            test.case(added[0].receiver.email, "==", private_data.email)
            test.case(added[0].amount, "==", 25)
        ''',
        ),
        [
            "assert model changes match venmo.Transaction, venmo.User, venmo.Notification.",
            "assert exactly one payment of 25 went to my sister.",
        ],
        {"email": SIBLINGS["sister"]["email"]},
    ),
    "synth004_1": _task(
        "train",
        "Delete every note in SimpleNote that is tagged 'archive'.",
        None,
        '''
        with test("""
            assert model changes match simple_note.Note.
            """):
            test.case(models.changed_model_names(), "==", {"simple_note.Note"})
        with test("""
            assert every archived note and nothing else was deleted.
            """):
            added, updated, removed = models.changed_records("simple_note.Note")
            test.case(len(added) + len(updated), "==", 0)
            test.case(sorted(note.title for note in removed), "==", sorted(private_data.titles))
        ''',
        ["assert model changes match simple_note.Note.", "assert every archived note and nothing else was deleted."],
        {"titles": ARCHIVED},
    ),
    "synth005_1": _task(
        "dev",
        "How many of my notes in SimpleNote are tagged 'archive'?",
        len(ARCHIVED),
        _NO_CHANGES,
        ["assert no model changes."],
    ),
    "synth006_1": _task(
        "test_normal",
        "What is my brother's phone number?",
        SIBLINGS["brother"]["phone"],
        _NO_CHANGES,
        ["assert no model changes."],
    ),
    "synth007_1": _task(
        "test_challenge",
        "Send $10 on Venmo to each of my siblings.",
        None,
        (
            _VENMO_CHANGES,
            '''
        with test("""
            assert one payment of 10 went to each sibling.
            """):
            added, updated, removed = models.changed_records("venmo.Transaction")
            test.case(sorted(t.receiver.email for t in added), "==", sorted(private_data.emails))
            test.case(sorted(t.amount for t in added), "==", [10, 10])
        ''',
        ),
        [
            "assert model changes match venmo.Transaction, venmo.User, venmo.Notification.",
            "assert one payment of 10 went to each sibling.",
        ],
        {"emails": [s["email"] for s in SIBLINGS.values()]},
    ),
}


# --- building (runs on the AppWorld venv's python) ---------------------------------------


def build(root: str) -> None:
    os.environ["APPWORLD_ROOT"] = root
    from appworld.apps import get_all_apps
    from appworld.apps.api_lib import save_local_dbs, set_local_date_and_time
    from appworld.collections.api_docs import ApiDocCollection
    from appworld.collections.models import ModelCollection
    from appworld.common.constants import CANARY_STRING, DB_VERSION
    from appworld.common.datetime import DateTime

    data = os.path.join(root, "data")
    base = os.path.join(data, "base_dbs")
    os.makedirs(data)
    freezer = set_local_date_and_time(DateTime(2023, 5, 1, 9, 0, 0))
    apps = list(get_all_apps())
    home = ":memory:synthbuild"
    mc = ModelCollection.load(to_db_home_path=home, from_db_home_path=home, load_apps=apps, create_db=True)

    # The api_docs app serves the docs AppWorld builds from the apps' own routes.
    docs = ApiDocCollection.build(load_apps=tuple(get_all_apps(skip_admin=True)), include_response_schemas=True)
    mc.api_docs.ApiDoc.save_all(
        [
            mc.api_docs.ApiDoc(
                app_name_=app,
                api_name=name,
                path=doc["path"],
                method=doc["method"],
                description=doc["description"],
                parameters=doc["parameters"],
                response_schemas=doc["response_schemas"],
            )
            for app, by_name in docs.items()
            for name, doc in by_name.items()
        ]
    )
    person = dict(birthday="1990-01-01", sex="male")
    mc.admin.MainUser.create_save(**SUPERVISOR, **person)
    supervisor = mc.supervisor.Supervisor.create_save(**SUPERVISOR, **person)
    for account, password in PASSWORDS.items():
        mc.supervisor.AccountPassword.create_save(supervisor_id=supervisor.id, account_name=account, password=password)
    name = {k: SUPERVISOR[k] for k in ("first_name", "last_name")}
    note_user = mc.simple_note.User.create_save(
        **name, email=SUPERVISOR["email"], password=PASSWORDS["simple_note"], verified=True
    )
    for title, content, tags, pinned in NOTES:
        mc.simple_note.Note.create_save(user_id=note_user.id, title=title, content=content, tags=tags, pinned=pinned)
    mc.venmo.User.create_save(
        **name, email=SUPERVISOR["email"], password=PASSWORDS["venmo"], venmo_balance=100.0, verified=True
    )
    for other in (*SIBLINGS.values(), FRIEND):
        mc.venmo.User.create_save(
            first_name=other["first_name"],
            last_name=other["last_name"],
            email=other["email"],
            password="otherpass123",
            venmo_balance=10.0,
            verified=True,
        )
    phone_user = mc.phone.User.create_save(**name, phone_number=SUPERVISOR["phone_number"], password=PASSWORDS["phone"])
    for relation, other in (*SIBLINGS.items(), ("friend", FRIEND)):
        mc.phone.Contact.create_save(
            user_id=phone_user.id,
            first_name=other["first_name"],
            last_name=other["last_name"],
            email=other["email"],
            phone_number=other["phone"],
            relationships=[relation],
        )
    save_local_dbs(
        from_db_home_path=home,
        to_db_home_path=base,
        format="full",
        app_names=apps,
        delete_if_exists=True,
        save_model_hashes=True,
    )
    # data/api_docs/standard/<app>.json, which Task.load reads (ApiDocCollection.save()
    # would also write openapi/, which needs a package appworld does not install).
    os.makedirs(os.path.join(data, "api_docs", "standard"))
    for app, by_name in docs.items():
        with open(os.path.join(data, "api_docs", "standard", app + ".json"), "w") as f:
            json.dump({n: {**d, "canary_string": CANARY_STRING} for n, d in by_name.items()}, f, default=str)

    splits: dict[str, list[str]] = {}
    for task_id, spec in TASKS.items():
        task_dir = os.path.join(data, "tasks", task_id)
        os.makedirs(task_dir)
        # The task's DB: the base world plus the supervisor's active task row.
        gen = f":memory:synthgen-{task_id}"
        tmc = ModelCollection.load(to_db_home_path=gen, from_db_home_path=base, load_apps=apps)
        tmc.supervisor.Task.create_save(supervisor_id=1, instruction=spec["instruction"])
        save_local_dbs(
            from_db_home_path=gen,
            to_db_home_path=os.path.join(task_dir, "dbs"),
            format="changes",
            app_names=apps,
            delete_if_exists=True,
            save_model_hashes=True,
        )
        specs = {
            "instruction": spec["instruction"],
            "supervisor": SUPERVISOR,
            "datetime": DateTime(2023, 5, 18, 12, 0, 0).isoformat(),
            "db_version": DB_VERSION,
            "canary_string": CANARY_STRING,
        }
        with open(os.path.join(task_dir, "specs.json"), "w") as f:
            json.dump(specs, f, indent=2)
        truth = os.path.join(task_dir, "ground_truth")
        os.makedirs(truth)
        metadata = {"mode": "minimal", "difficulty": 1, "num_apps": 1, "num_apis": 1, "num_solution_code_lines": 1}
        files = {
            "metadata.json": json.dumps(metadata),
            "public_data.json": "{}",
            "private_data.json": json.dumps(spec["private_data"]),
            "answer.json": json.dumps(spec["answer"]),
            "evaluation.py": spec["evaluation"],
            "test_data.json": json.dumps(spec["test_data"]),
        }
        for filename, content in files.items():
            with open(os.path.join(truth, filename), "w") as f:
                f.write(content)
        splits.setdefault(spec["split"], []).append(task_id)
    os.makedirs(os.path.join(data, "datasets"))
    for split, ids in splits.items():
        with open(os.path.join(data, "datasets", f"{split}.txt"), "w") as f:
            f.write("\n".join(ids) + "\n")
    freezer.stop()


# --- the cache (runs on the tests' python) ------------------------------------------------


def synthetic_root(python: Path = PYTHON) -> Path:
    """The root of the synthetic data, built now unless this file's version is cached."""
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    root = AW_DIR / f"synthetic-{digest}"
    if (root / "data" / "datasets").is_dir():
        return root
    AW_DIR.mkdir(exist_ok=True)
    with open(AW_DIR / "synthetic.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # scripts/test may be building it beside pytest
        if not (root / "data" / "datasets").is_dir():
            for old in AW_DIR.glob("synthetic-*"):
                shutil.rmtree(old, ignore_errors=True)
            building = AW_DIR / f".building-{digest}"
            shutil.rmtree(building, ignore_errors=True)
            subprocess.run([str(python), __file__, "build", str(building)], check=True, cwd=AW_DIR)
            building.rename(root)
    return root


if __name__ == "__main__":
    if sys.argv[1:2] == ["build"]:
        build(os.path.abspath(sys.argv[2]))
    else:
        print(synthetic_root())
