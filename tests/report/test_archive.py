"""prmppo.report.archive and reports read from an archive, on a real one: `fixtures/smoke_study/runs.tar.xz`
holds a 2-arm x 2-seed `debug=smoke` sweep (`fixtures/smoke_study/README.md` has its command).

- packing keeps the run records only and gives the same bytes for the same files, whatever their dates,
  modes and location; it refuses an archive above the size limit and writes nothing;
- an archive with an unsafe member is refused;
- the report read from the archive is the committed RESULTS.md byte for byte, from any working directory,
  and names the runs inside it `<archive's file name>:<member dir>`;
- scripts/check_reproduce.sh passes the fixture study and fails when its RESULTS.md was edited.
"""

from __future__ import annotations

import io
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from prmppo.report import write_report
from prmppo.report.__main__ import main as report_main
from prmppo.report.archive import ArchiveError, RUN_FILES, SWEEP_FILES, members, pack, unpack
from prmppo.report.archive.__main__ import main as archive_main

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
STUDY = FIXTURES / "smoke_study"
RUNS = ["0_prm_seed0", "1_prm_seed1", "2_orm_seed0", "3_orm_seed1"]


def _tar(archive: Path) -> bytes:
    """The archive's tar stream: Python's tarfile writes it, so it is the same on every machine (the xz layer
    comes from the system's liblzma, whose output may differ between its versions)."""
    return lzma.decompress(archive.read_bytes())


@pytest.fixture
def sweep(tmp_path) -> Path:
    """The fixture's sweep unpacked, with what a real sweep directory also holds beside the records."""
    root = unpack(STUDY / "runs.tar.xz", tmp_path / "unpacked") / "smoke"
    for run in RUNS:
        (root / run / "checkpoints" / "final").mkdir(parents=True)
        (root / run / "checkpoints" / "final" / "model.safetensors").write_bytes(b"\0" * 4096)
        (root / run / "worker.log").write_text("engine log\n")
    (root / "multirun.log").write_text("")
    return root


def test_pack_keeps_the_run_records_and_gives_the_same_bytes_for_the_same_files(sweep, tmp_path):
    files = members([sweep])
    names = {f"smoke/{run}/{name}" for run in RUNS for name in RUN_FILES if (sweep / run / name).exists()}
    assert set(files) == names | {f"smoke/{name}" for name in SWEEP_FILES}
    assert list(files) == sorted(files)  # no weights, checkpoints or logs; in name order
    assert {f"smoke/{run}/eval.json" for run in RUNS} <= names and not any("checkpoints" in n for n in files)
    pack([sweep], tmp_path / "a.tar.xz")
    # the same files with other dates and modes, in another place: the same bytes
    moved = shutil.copytree(sweep, tmp_path / "elsewhere" / "smoke")
    for path in moved.rglob("*"):
        if path.is_file():
            os.utime(path, (1e9, 1e9))
            path.chmod(0o600)
    pack([moved], tmp_path / "b.tar.xz")
    assert (tmp_path / "a.tar.xz").read_bytes() == (tmp_path / "b.tar.xz").read_bytes()
    # and the tar stream the fixture was packed as
    assert _tar(tmp_path / "a.tar.xz") == _tar(STUDY / "runs.tar.xz")
    with tarfile.open(tmp_path / "a.tar.xz") as tar:
        assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in tar} == {(0, 0, 0, "", "", 0o644)}


def test_pack_keeps_the_per_problem_outcomes_of_each_evaluation_during_ppo(sweep, tmp_path):
    (sweep / RUNS[0] / "ppo_eval").mkdir()
    for n in (0, 25):
        (sweep / RUNS[0] / "ppo_eval" / f"iteration_{n:05d}.json").write_text('{"problems": []}')
    (sweep / RUNS[0] / "ppo_eval" / "notes.txt").write_text("not an evaluation")
    kept = [name for name in members([sweep]) if "/ppo_eval/" in name]
    assert kept == [f"smoke/{RUNS[0]}/ppo_eval/iteration_00000.json", f"smoke/{RUNS[0]}/ppo_eval/iteration_00025.json"]
    pack([sweep], tmp_path / "a.tar.xz")
    assert (unpack(tmp_path / "a.tar.xz", tmp_path / "back") / "smoke" / RUNS[0] / "ppo_eval" /
            "iteration_00025.json").read_text() == '{"problems": []}'


def test_pack_refuses_what_it_cannot_keep(sweep, tmp_path):
    out = tmp_path / "big.tar.xz"
    with pytest.raises(ArchiveError, match=r"would be 0\.0 MB, above the 0\.001 MB limit .* the largest files: smoke/"):
        pack([sweep], out, max_bytes=1000)
    assert not out.exists()  # nothing written
    with pytest.raises(ArchiveError, match=r"must end in \.tar\.xz, got 'runs\.zip'"):
        pack([sweep], tmp_path / "runs.zip")
    other = shutil.copytree(sweep, tmp_path / "other" / "smoke")
    with pytest.raises(ArchiveError, match="have the same name 'smoke'"):
        pack([sweep, other], out)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ArchiveError, match="no runs under"):
        pack([tmp_path / "empty"], out)


def test_archive_cli(sweep, tmp_path, capsys):
    assert archive_main([str(sweep), "--out", str(tmp_path / "runs.tar.xz")]) == 0
    assert capsys.readouterr().out.strip() == f"{tmp_path / 'runs.tar.xz'}: 4 runs, {len(members([sweep]))} files"
    assert archive_main([str(tmp_path / "nothing"), "--out", str(tmp_path / "x.tar.xz")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    # as a module: no warning about the package importing it first
    proc = subprocess.run([sys.executable, "-W", "error", "-m", "prmppo.report.archive", "--help"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0 and "--out" in proc.stdout, proc.stderr


@pytest.mark.parametrize("kind", ["parent", "absolute", "link"])
def test_unpack_refuses_a_member_outside_the_archive(tmp_path, kind):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as tar:
        info = tarfile.TarInfo({"parent": "../evil.txt", "absolute": "/tmp/evil.txt", "link": "run/x"}[kind])
        if kind == "link":
            info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info, io.BytesIO(b""))
    (tmp_path / "bad.tar.xz").write_bytes(buffer.getvalue())
    with pytest.raises(ArchiveError, match="is not a regular file with a relative name"):
        unpack(tmp_path / "bad.tar.xz", tmp_path / "out")


def test_report_from_the_archive_is_the_committed_results_byte_for_byte(tmp_path, monkeypatch):
    study = shutil.copytree(STUDY, tmp_path / "study")
    monkeypatch.chdir(study)  # as reproduce.sh runs it: from the study directory
    (study / "RESULTS.md").unlink()
    assert report_main(["runs.tar.xz", "--out", ".", "--name", "RESULTS.md", "--threshold", "0.5"]) == 0
    text = (study / "RESULTS.md").read_text()
    assert text == (STUDY / "RESULTS.md").read_text()
    assert "4 runs from `runs.tar.xz`" in text and "`runs.tar.xz:smoke`" in text and str(tmp_path) not in text
    # from another directory (as experiments/<study>/runs.tar.xz from the repository's root): the same markdown,
    # and the figures the same bytes when made twice on one machine
    first = {png.name: png.read_bytes() for png in study.glob("*.png")}
    assert set(first) == {"accuracy.png", "rewards.png", "hacking.png"}
    monkeypatch.chdir(tmp_path)
    write_report([Path("study") / "runs.tar.xz"], tmp_path / "again", 0.5, "RESULTS.md")
    assert (tmp_path / "again" / "RESULTS.md").read_text() == text
    assert {png.name: png.read_bytes() for png in (tmp_path / "again").glob("*.png")} == first
    assert b"Software" not in first["accuracy.png"]  # no matplotlib version in the metadata


def test_a_run_inside_an_archive_is_named_by_the_archive(sweep, tmp_path, capsys):
    result = sweep / "2_orm_seed0" / "stage_result.json"
    result.write_text(result.read_text().replace('"status": "ok"', '"status": "failed"'))
    pack([sweep], tmp_path / "study" / "runs.tar.xz")
    text = write_report([tmp_path / "study" / "runs.tar.xz"], tmp_path / "out").read_text()
    assert "| `runs.tar.xz:smoke/2_orm_seed0` | failed |" in text and str(tmp_path) not in text
    assert "/prmppo-report-" not in text  # no temporary directory
    # a damaged archive, and a report error about a run inside one, name the archive
    (tmp_path / "bad.tar.xz").write_bytes(b"not xz")
    assert report_main([str(tmp_path / "bad.tar.xz"), "--out", str(tmp_path / "o")]) == 2
    assert f"{tmp_path / 'bad.tar.xz'} cannot be read as a .tar.xz archive" in capsys.readouterr().err
    (sweep / "3_orm_seed1" / "metrics.jsonl").write_text("{not json\n\n")
    pack([sweep], tmp_path / "broken.tar.xz")
    assert report_main([str(tmp_path / "broken.tar.xz"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'broken.tar.xz'}:smoke/3_orm_seed1/metrics.jsonl line 1 is not valid JSON" in err
    assert "/prmppo-report-" not in err


@pytest.mark.slow  # regenerates the fixture study twice; CI runs scripts/check_reproduce.sh itself
def test_check_reproduce_passes_the_fixture_study_and_fails_an_edited_one(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    script = REPO / "scripts" / "check_reproduce.sh"
    proc = subprocess.run(["bash", str(script), str(FIXTURES)], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and "check_reproduce: smoke_study: ok" in proc.stdout, proc.stdout + proc.stderr
    edited = shutil.copytree(FIXTURES, tmp_path / "fixtures")
    results = edited / "smoke_study" / "RESULTS.md"
    results.write_text(results.read_text().replace("4 runs from", "5 runs from"))
    proc = subprocess.run(["bash", str(script), str(edited)], capture_output=True, text=True, env=env)
    assert proc.returncode == 1 and "RESULTS.md differs from what its archive regenerates" in proc.stdout
    assert "-5 runs from `runs.tar.xz`" in proc.stdout and "+4 runs from `runs.tar.xz`" in proc.stdout
