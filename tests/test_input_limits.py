"""Every input case of issue #23's "What was found" is refused in one line, without a
traceback: through ``Plan.load`` (the file alone, all that ``qsync-lab run`` has before it
starts torchrun), ``load_cluster``, ``read_profile``, the atomic writers and the CLI."""

import copy
import json
import os
import subprocess

import pytest

from qsync_lab.cli import main
from qsync_lab.cluster import load_cluster
from qsync_lab.costs.profiles import read_profile
from qsync_lab.errors import QSyncError
from qsync_lab.io import atomic_write_text, open_log
from qsync_lab.limits import MAX_FILE_BYTES
from qsync_lab.plan import PLAN_TYPE, Plan


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    from tests.runtime.conftest import write_plan

    folder = tmp_path_factory.mktemp("plan")
    return write_plan(folder / "plan.json", "local-cpu", {}, model="digits_mlp",
                      task="synthetic")


@pytest.fixture(scope="module")
def document(plan_file):
    return json.loads(plan_file.read_text())


def _written(document, tmp_path, edit=None, raw=None):
    """``document`` with ``edit`` applied, written to a file; ``raw``: a (text, text)
    replacement in the JSON text (for what ``json.dumps`` does not write, e.g. Infinity)."""
    document = copy.deepcopy(document)
    if edit is not None:
        edit(document["_data"])
    text = json.dumps(document)
    if raw is not None:
        assert raw[0] in text
        text = text.replace(*raw)
    path = tmp_path / "edited.json"
    path.write_text(text)
    return path


def _one_line(call, match):
    with pytest.raises(QSyncError, match=match) as err:
        call()
    assert type(err.value) is QSyncError and "\n" not in str(err.value)
    return str(err.value)


def _rank0(**fields):
    return lambda data: data["ranks"][0].update(fields)


def _group0(**fields):
    return lambda data: data["cluster"]["definition"]["node"][0]["devices"][0].update(fields)


@pytest.mark.parametrize("edit, match", [
    (_rank0(batch_size=0), r"ranks\[0\]: batch_size: expected an integer in 1..1048576, got 0"),
    (_rank0(batch_size=-16), "batch_size: expected an integer in 1..1048576, got -16"),
    (_rank0(batch_size=16.9), "batch_size: expected an integer in 1..1048576, got 16.9"),
    (_rank0(batch_size=1e308), "batch_size: expected an integer in 1..1048576, got 1e"),
    (_rank0(batch_size=2**20 + 1), "got 1048577"),
    (_rank0(batch_size=True), "got True"),
    (lambda data: data["ranks"][1].update(rank=5), r"ranks\[1\] has rank id 5; rank ids run 0..1"),
    (lambda data: data["ranks"][1].update(rank=0), r"ranks\[1\] has rank id 0"),
    (lambda data: data.update(compression={"_default": "zip"}),
     "unknown compression method 'zip'"),
    (lambda data: data.update(compression={"_default": {"method": ["fp16"]}}),
     r"unknown compression method \['fp16'\]"),
    (lambda data: data.update(compression={"_default": {"method": "fp16", "bits": 99}}),
     "bits must be an integer in 1..32, got 99"),
    (lambda data: data.update(compression=[]), "compression settings must be a spec or"),
    (lambda data: data["model"].update(name="../../etc/passwd"),
     "model '../../etc/passwd' is neither a zoo model name nor a module:function spec"),
    (lambda data: data["model"].update(kwargs={"hidden": list(range(2000))}),
     "model kwargs: more than 1000 values"),
    (_group0(count=10**9), r"node\[0\].devices\[0\].count: 1000000000 is over the limit of 4096"),
    (_group0(kind="Z80"), "unknown device 'Z80'"),
    (lambda data: data["ranks"][0].update(batchsize=3),
     r"_data.ranks\[0\].batchsize: unknown key; expected one of: batch_size, device, rank"),
    (lambda data: data["model"].update(fingerprint={"sha": 1}),
     "_data.model.fingerprint: expected a non-empty string"),
    (lambda data: data["precisions"].update({"T4": {"fc1": "fp16"}}),
     "the plan has device kind 'T4', which cluster 'local-cpu' does not have"),
])
def test_a_malformed_plan_file_is_refused_in_one_line(document, tmp_path, edit, match):
    path = _written(document, tmp_path, edit)
    _one_line(lambda: Plan.load(path), match)


@pytest.mark.parametrize("constant", ["Infinity", "-Infinity", "NaN"])
def test_non_finite_numbers_are_refused_by_the_parser(document, tmp_path, constant):
    """``json.loads`` takes them; a batch of Infinity used to be an OverflowError."""
    path = _written(document, tmp_path, _rank0(batch_size=12345),
                    raw=('"batch_size": 12345', f'"batch_size": {constant}'))
    _one_line(lambda: Plan.load(path), f"{constant} is not a finite number")


def test_an_integer_of_thousands_of_digits_is_refused(document, tmp_path):
    path = _written(document, tmp_path, _rank0(batch_size=12345),
                    raw=('"batch_size": 12345', '"batch_size": ' + "9" * 5000))
    _one_line(lambda: Plan.load(path), "a number has too many digits")


@pytest.mark.parametrize("depth", [40, 100_000])
def test_deeply_nested_json_is_refused(document, tmp_path, depth):
    """Below the interpreter's recursion limit by the depth check, above it by catching
    the RecursionError (3,001 lines of traceback before)."""
    path = _written(document, tmp_path, lambda data: data.update(strategy="X"),
                    raw=('"strategy": "X"', '"strategy": ' + "[" * depth + "]" * depth))
    _one_line(lambda: Plan.load(path), "nested deeper than 32 levels")


def test_a_plan_over_the_size_limit_is_refused_before_reading(tmp_path):
    path = tmp_path / "huge.json"
    with open(path, "wb") as handle:
        handle.truncate(MAX_FILE_BYTES + 1)  # sparse: nothing to read if it were read
    _one_line(lambda: Plan.load(path), f"has {MAX_FILE_BYTES + 1} bytes, over the limit")


def test_a_plan_that_is_not_a_regular_file_is_refused(tmp_path):
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)  # reading it would block forever
    _one_line(lambda: Plan.load(fifo), "not a regular file")


def _cluster_toml(tmp_path, devices, extra=""):
    path = tmp_path / "cluster.toml"
    path.write_text(f'name = "c"\nbatch_size = 8\n{extra}\n[[node]]\nname = "n"\n'
                    f'intra_node_link = "loopback"\ndevices = [{devices}]\n')
    return path


def test_a_cluster_with_a_huge_device_count_is_refused_before_making_its_ranks(tmp_path):
    """A count of 10**12 used to build 10**12 rank objects (MemoryError)."""
    path = _cluster_toml(tmp_path, '{ kind = "T4", count = 1000000000000 }')
    _one_line(lambda: load_cluster(path), "count: 1000000000000 is over the limit of 4096")
    path = _cluster_toml(tmp_path, ", ".join(['{ kind = "T4", count = 4000 }'] * 2))
    _one_line(lambda: load_cluster(path), r"devices\[1\].count: 8000 ranks so far, over the limit")


@pytest.mark.parametrize("depth", [40, 100_000])
def test_a_deeply_nested_toml_is_refused(tmp_path, depth):
    path = _cluster_toml(tmp_path, '{ kind = "T4" }',
                         extra="description = " + "[" * depth + "]" * depth)
    _one_line(lambda: load_cluster(path), "nested deeper than 32 levels")


def test_a_cluster_file_over_the_size_limit_is_refused(tmp_path):
    path = tmp_path / "big.toml"
    with open(path, "wb") as handle:
        handle.truncate(MAX_FILE_BYTES + 1)
    _one_line(lambda: load_cluster(path), "over the limit")


def test_a_profile_over_the_size_limit_or_with_infinite_times_is_refused(tmp_path):
    path = tmp_path / "big.csv"
    with open(path, "wb") as handle:
        handle.truncate(MAX_FILE_BYTES + 1)
    _one_line(lambda: read_profile(path), "over the limit")
    path = tmp_path / "inf.csv"
    path.write_text("device,op,kind,shape_key,precision,phase,batch_size,numel,flops,bytes,"
                    "time_us,repeats\nT4,fc,linear,,fp16,forward,32,0,1,1,inf,20\n")
    _one_line(lambda: read_profile(path), "time_us must be a number >= 0 and finite, got 'inf'")


def test_no_output_is_written_through_a_symlink(tmp_path, document):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    link = tmp_path / "plan.json"
    link.symlink_to(victim)
    plan = Plan.from_dict(document)
    message = _one_line(lambda: plan.save(link), "refusing to write through the symlink")
    assert message.endswith(f"{link}; remove it or choose another path")
    _one_line(lambda: atomic_write_text(link, "x"), "refusing to write through the symlink")
    _one_line(lambda: open_log(link), "refusing to write through the symlink")
    assert victim.read_text() == "precious" and link.is_symlink()


def test_no_output_is_written_into_a_symlinked_folder_inside_the_chosen_one(tmp_path):
    """``run/ranks -> elsewhere``: a file written to run/ranks/ would land elsewhere; the
    chosen folder itself may be a symlink."""
    outside, run = tmp_path / "outside", tmp_path / "run"
    outside.mkdir()
    run.mkdir()
    (run / "ranks").symlink_to(outside)
    _one_line(lambda: atomic_write_text(run / "ranks" / "rank0.json", "{}", within=run),
              f"refusing to write through the symlink {run / 'ranks'}; remove it")
    assert not any(outside.iterdir())
    (tmp_path / "chosen").symlink_to(run)
    atomic_write_text(tmp_path / "chosen" / "summary.json", "{}", within=tmp_path / "chosen")
    assert (run / "summary.json").read_text() == "{}"


def _v1_document(document, source):
    data = document["_data"]
    return {"_type": PLAN_TYPE, "_version": 1, "_data": {
        "model_fingerprint": data["model"]["fingerprint"],
        "cluster": {"name": "local-cpu", "source": str(source)}, "ranks": data["ranks"],
        "precisions": {}, "gradient_compression": {}, "strategy": "qsync",
        "model": {"name": "digits_mlp", "kwargs": {}}}}


def test_a_version_1_cluster_source_must_be_a_regular_toml_file(document, tmp_path):
    """Its ``source`` used to be read as TOML whatever it was."""
    shipped = load_cluster("local-cpu").source
    link = tmp_path / "cluster.toml"
    link.symlink_to(shipped)
    not_toml = tmp_path / "passwd"
    not_toml.write_text("root:x:0:0::/root:/bin/bash\n")
    for source, match in ((link, "is a symlink; point source at the cluster file itself"),
                          (not_toml, "is not a cluster .toml file")):
        path = tmp_path / "v1.json"
        path.write_text(json.dumps(_v1_document(document, source)))
        _one_line(lambda: Plan.load(path), f"_data.cluster.source: {source} {match}")


@pytest.fixture
def no_torchrun(monkeypatch):
    """Fail the test if anything tries to start a process."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a process was started: {args[0]}")
    monkeypatch.setattr(subprocess, "Popen", refuse)


@pytest.mark.parametrize("edit, match", [
    (_rank0(batch_size=0), "batch_size: expected an integer in 1..1048576, got 0"),
    (lambda data: data.update(compression={"fc9.weight": "fp16"}),
     "the plan compresses parameter 'fc9.weight', which the model does not have"),
])
def test_run_refuses_a_bad_plan_before_starting_torchrun(document, tmp_path, capsys, edit,
                                                         match, no_torchrun):
    """``qsync-lab run`` has the file alone; an unknown compressed parameter needs the
    model, which the launcher now builds and traces before it starts anything."""
    path = _written(document, tmp_path, edit)
    code = main(["run", "--plan", str(path), "--run-dir", str(tmp_path / "run")])
    _, err = capsys.readouterr()
    assert code == 2 and err.startswith("qsync-lab: error: plan ") and err.count("\n") == 1
    assert match in err
    assert not (tmp_path / "run").exists()


def test_run_refuses_a_bad_profile_before_starting_torchrun(plan_file, tmp_path, capsys,
                                                            no_torchrun):
    """The prediction reads it at the end of the run: it used to fail after training."""
    profile = tmp_path / "bad.csv"
    profile.write_text("device,op,kind,shape_key,precision,phase,batch_size,numel,flops,bytes,"
                       "time_us,repeats\ncpu,fc,linear,,fp32,forward,32,0,1,1,inf,20\n")
    code = main(["run", "--plan", str(plan_file), "--run-dir", str(tmp_path / "run"),
                 "--profile", str(profile)])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1
    assert "profile bad.csv, data row 1: time_us must be a number >= 0 and finite, got 'inf'" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("output", ["summary.json", "final.safetensors", "metrics.jsonl",
                                    "launch.log", "ranks", "ranks/rank1.json",
                                    "checkpoint-00000020.safetensors"])
def test_run_refuses_a_symlinked_output_before_starting_torchrun(plan_file, tmp_path, capsys,
                                                                 output, no_torchrun):
    run, victim = tmp_path / "run", tmp_path / "victim"
    victim.mkdir()
    (run / output).parent.mkdir(parents=True)
    (run / output).symlink_to(victim)
    code = main(["run", "--plan", str(plan_file), "--run-dir", str(run)])
    _, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1
    assert f"refusing to write through the symlink {run / output}; remove it" in err
    assert not any(victim.iterdir())
