"""Dev-only: the real Python huggingface_hub client against tallow's loopback hub.

The loopback hub (tests/src/hub_server.rs) was written from the same reading of the Hub API as
tallow's client (crates/hub/), so a shared misreading would pass the hub tests. This script runs
the reference client, huggingface_hub (pinned below), against that server for the operations
tallow's client does: whoami, create a repo (and again: 409), create a branch, commit regular and
LFS files (preupload, LFS batch / PUT / verify, the NDJSON commit; an LFS object the server holds
is not sent again), list files (repo info siblings and the tree), download single files, whole
snapshots at a tag, gated / missing repo / revision / file errors, and dataset files and
snapshots. Each operation's outcome is checked here (downloaded bytes equal to the fixture files
or to what was uploaded, the error class the client raises, ...), and every HTTP exchange is
recorded, at the client's transport, into

    tests/fixtures/hub/hf_client_exchange.json

`hub_cli::real_client_exchange_replays` replays those requests against the server and requires
the same answers, so CI checks the server against what the real client sent and accepted
without Python. Re-run this after changing the server:

    cargo build -p tallow-tests --bin hub-server
    /work/pyref5/bin/python scripts/make_hub_client_fixtures.py

(venv: scripts/requirements-fixtures-v5.txt, which pins huggingface_hub 2.4.0; `--server PATH`
names another hub-server binary, `--out PATH` another output, `--no-write` only checks.)

Xet is off (HF_HUB_DISABLE_XET=1): the loopback hub speaks the LFS "basic" transfer only, as
tallow's uploader does, and never sends `X-Xet-Hash`.
"""

import argparse
import base64
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HUB_VERSION = "2.4.0"
ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
TOKEN = "hf_tallow_test_token"  # tests/src/hub_server.rs: TOKEN, user tallow-test (write)
MODEL = "tallow-test/tiny-qwen2"
GATED = "tallow-test/gated"
DATASET = "tallow-test/chat"
SHARDED = "tallow-test/sharded"
NEW_REPO = "tallow-test/from-python"

# Request headers that say nothing about the exchange (random, or the client's versions).
VOLATILE = {"host", "user-agent", "x-amzn-trace-id"}


def sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", default=str(ROOT / "target" / "debug" / "hub-server"))
    ap.add_argument("--out", default=str(FIXTURES / "hub" / "hf_client_exchange.json"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    server = subprocess.Popen(
        [args.server], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    urls = dict(server.stdout.readline().strip().split("=", 1) for _ in range(2))
    hub, cdn = urls["HF_ENDPOINT"], urls["CDN"]
    home = tempfile.mkdtemp(prefix="hf-client-")
    # Before huggingface_hub is imported: its constants read the environment at import.
    for k in ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_CACHE", "HF_HUB_OFFLINE"]:
        os.environ.pop(k, None)
    os.environ.update(
        HF_ENDPOINT=hub,
        HF_HOME=home,
        HF_HUB_DISABLE_XET="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HUB_DISABLE_IMPLICIT_TOKEN="1",
    )
    try:
        record = run(hub, cdn)
    finally:
        server.stdin.close()
        server.wait(timeout=10)
    failed = [o for o in record["operations"] if not o["ok"]]
    for o in failed:
        print(f"FAILED {o['op']} {o['args']}: {o['error']}", file=sys.stderr)
    print(f"{len(record['operations']) - len(failed)} passed, {len(failed)} failed")
    if failed:
        sys.exit(1)
    if not args.no_write:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
        print(f"wrote {out} ({len(record['exchanges'])} exchanges)")


def run(hub: str, cdn: str) -> dict:
    import httpx2
    import huggingface_hub as hh
    from huggingface_hub import CommitOperationAdd, HfApi
    from huggingface_hub import errors as hf_errors
    from huggingface_hub.utils import _http

    assert hh.__version__ == HUB_VERSION, f"huggingface_hub {hh.__version__}, want {HUB_VERSION}"

    def norm(s: str) -> str:
        return s.replace(hub, "{hub}").replace(cdn, "{cdn}")

    def body_of(b: bytes, replayable: bool):
        if not b:
            return {"text": ""}
        try:
            text = b.decode("utf-8")
            if "\0" not in text:
                return {"text": norm(text)}
        except UnicodeDecodeError:
            pass
        if replayable or len(b) <= 1024:
            return {"base64": base64.b64encode(b).decode()}
        return {"sha256": sha256(b), "len": len(b)}

    exchanges = []

    class Recorder(httpx2.BaseTransport):
        """Every request and answer as the client's transport sees them (redirect hops too)."""

        def __init__(self):
            self.inner = httpx2.HTTPTransport()

        def handle_request(self, request):
            sent = request.read()
            response = self.inner.handle_request(request)
            try:
                content = response.read()
            finally:
                response.close()
            origin = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
            exchanges.append(
                {
                    "request": {
                        "origin": {hub: "hub", cdn: "cdn"}.get(origin, origin),
                        "method": request.method,
                        "target": norm(request.url.raw_path.decode()),
                        "headers": [
                            [k.lower(), norm(v)]
                            for k, v in request.headers.multi_items()
                            if k.lower() not in VOLATILE
                        ],
                        "body": body_of(sent, replayable=True),
                    },
                    "response": {
                        "status": response.status_code,
                        "headers": [[k.lower(), norm(v)] for k, v in response.headers.multi_items()],
                        "body": body_of(content, replayable=False),
                    },
                }
            )
            return httpx2.Response(
                status_code=response.status_code,
                headers=response.headers,
                content=content,
                request=request,
                extensions=response.extensions,
            )

    recorder = Recorder()
    _http.set_client_factory(
        lambda: httpx2.Client(
            event_hooks={"request": [_http.hf_request_event_hook]},
            follow_redirects=True,
            timeout=None,
            transport=recorder,
        )
    )
    api = HfApi(endpoint=hub)
    operations = []

    def op(name, fn, expect_error=None, **kwargs):
        """Runs one client call; `fn` returns its checked outcome (JSON) or raises."""
        start = len(exchanges)
        entry = {"op": name, "args": kwargs}
        try:
            result = fn()
            if expect_error is not None:
                raise AssertionError(f"expected {expect_error.__name__}, got {result!r}")
            entry.update(ok=True, result=result)
        except Exception as e:  # noqa: BLE001 - each failure is reported by name
            if expect_error is not None and isinstance(e, expect_error):
                entry.update(ok=True, result={"error": type(e).__name__})
            else:
                entry.update(ok=False, error=f"{type(e).__name__}: {e}")
        entry["exchanges"] = [start, len(exchanges)]
        operations.append(entry)
        return entry.get("result")

    def commit_of(path: str) -> str:
        """The commit of a cache path (`.../snapshots/<commit>/...`)."""
        parts = Path(path).parts
        return parts[parts.index("snapshots") + 1]

    def download(repo, filename, want: bytes, **kw):
        def fn():
            p = hh.hf_hub_download(repo, filename, **kw)
            got = Path(p).read_bytes()
            assert got == want, f"{filename}: {len(got)} bytes, sha256 {sha256(got)}; want {sha256(want)}"
            return {"commit": commit_of(p), "files": {filename: sha256(got)}}

        return fn

    def snapshot(repo, want: dict, **kw):
        def fn():
            d = Path(hh.snapshot_download(repo, max_workers=1, **kw))
            got = {
                p.relative_to(d).as_posix(): p.read_bytes()
                for p in sorted(d.rglob("*"))
                if p.is_file()
            }
            assert sorted(got) == sorted(want), f"files {sorted(got)}, want {sorted(want)}"
            for k, b in want.items():
                assert got[k] == b, f"{k} differs"
            return {"commit": d.name, "files": {k: sha256(b) for k, b in got.items()}}

        return fn

    # --- the write half: what `tallow upload` / `train.push_to_hub` do.
    op("whoami", lambda: {"name": api.whoami(token=TOKEN)["name"]})
    want_url = f"{hub}/{NEW_REPO}"

    def create(**kw):
        url = api.create_repo(NEW_REPO, token=TOKEN, **kw)
        assert str(url) == want_url, f"{url} != {want_url}"
        return {"repo_id": url.repo_id}

    op("create_repo", lambda: create(private=False), repo_id=NEW_REPO)
    op("create_repo exist_ok", lambda: create(exist_ok=True), repo_id=NEW_REPO)
    op(
        "create_repo again",
        lambda: create(),
        expect_error=hf_errors.HfHubHTTPError,
        repo_id=NEW_REPO,
    )
    op(
        "create_branch",
        lambda: api.create_branch(NEW_REPO, branch="dev", token=TOKEN) or {},
        repo_id=NEW_REPO,
        branch="dev",
    )

    # A small safetensors file (LFS by its name), a JSON config and a model card (regular).
    header = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}})
    header = header.encode() + b" " * (-len(header) % 8)
    weights = len(header).to_bytes(8, "little") + header + bytes(range(16))
    config = b'{"model_type": "qwen2", "hidden_size": 8}\n'
    card = b"---\nlibrary_name: peft\nbase_model: tallow-test/tiny-qwen2\n---\n# from python\n"
    uploaded = {"adapter_model.safetensors": weights, "adapter_config.json": config, "README.md": card}

    def commit(files: dict, revision=None):
        def fn():
            info = api.create_commit(
                NEW_REPO,
                [CommitOperationAdd(path_in_repo=k, path_or_fileobj=v) for k, v in files.items()],
                commit_message=f"Upload {len(files)} files",
                revision=revision,
                token=TOKEN,
                num_threads=1,
            )
            assert len(info.oid) == 40, info.oid
            assert info.commit_url == f"{hub}/{NEW_REPO}/commit/{info.oid}", info.commit_url
            return {"commit": info.oid}

        return fn

    first = op("create_commit", commit(uploaded), repo_id=NEW_REPO, files=sorted(uploaded))
    # The same LFS bytes under another name, on the branch: the batch answers with no upload
    # action, so no PUT is made (checked on the exchanges below).
    extra = {"copy/adapter_model.safetensors": weights, "notes.txt": b"on the dev branch\n"}
    op(
        "create_commit on a branch",
        commit(extra, revision="dev"),
        repo_id=NEW_REPO,
        revision="dev",
        files=sorted(extra),
    )
    dev_puts = [
        e
        for e in exchanges[operations[-1]["exchanges"][0] : operations[-1]["exchanges"][1]]
        if e["request"]["method"] == "PUT"
    ]
    assert operations[-1]["ok"] is False or not dev_puts, "an LFS object the hub holds was sent again"

    def listing(revision, want):
        def fn():
            info = api.model_info(NEW_REPO, revision=revision, token=TOKEN)
            siblings = sorted(s.rfilename for s in info.siblings)
            tree = sorted(api.list_repo_files(NEW_REPO, revision=revision, token=TOKEN))
            assert siblings == tree == sorted(want), f"siblings {siblings}, tree {tree}, want {sorted(want)}"
            return {"sha": info.sha, "files": siblings}

        return fn

    on_main = [".gitattributes", *uploaded]
    op("model_info + list_repo_files", listing("main", on_main), repo_id=NEW_REPO, revision="main")
    # The branch was made from main before the first commit.
    on_dev = [".gitattributes", *extra]
    op("model_info + list_repo_files", listing("dev", on_dev), repo_id=NEW_REPO, revision="dev")
    if first:
        for name, b in uploaded.items():
            op(
                "hf_hub_download",
                download(NEW_REPO, name, b, revision=first["commit"], token=TOKEN),
                repo_id=NEW_REPO,
                filename=name,
                revision=first["commit"],
            )
    op(
        "hf_hub_download",
        download(NEW_REPO, "notes.txt", extra["notes.txt"], revision="dev", token=TOKEN),
        repo_id=NEW_REPO,
        filename="notes.txt",
        revision="dev",
    )

    # --- the read half: what `tallow download` / `--model OWNER/NAME` / `hf://datasets` do.
    tiny = {p.name: p.read_bytes() for p in (FIXTURES / "models" / "tiny-qwen2").iterdir()}
    model_files = {
        **tiny,
        "README.md": b"# tiny-qwen2\n",
        "pytorch_model.bin": b"not used: a .bin duplicate",
        "original/params.json": b'{"dim": 64}',
    }
    for rev in ["v1", "main"]:
        want = {**model_files, "extra.json": f'{{"rev":"{rev}"}}'.encode()}
        op("snapshot_download", snapshot(MODEL, want, revision=rev), repo_id=MODEL, revision=rev)
    op(
        "hf_hub_download",
        download(MODEL, "model.safetensors", tiny["model.safetensors"], revision="v1"),
        repo_id=MODEL,
        filename="model.safetensors",
        revision="v1",
    )
    op(
        "hf_hub_download",
        download(GATED, "config.json", tiny["config.json"], token=TOKEN),
        repo_id=GATED,
        filename="config.json",
        token=True,
    )
    for name, kw, err in [
        ("gated, no token", dict(repo_id=GATED, filename="config.json"), hf_errors.GatedRepoError),
        (
            "gated, wrong token",
            dict(repo_id=GATED, filename="config.json", token="hf_wrong"),
            hf_errors.GatedRepoError,
        ),
        ("missing repo", dict(repo_id="tallow-test/nope", filename="config.json"), hf_errors.RepositoryNotFoundError),
        (
            "missing revision",
            dict(repo_id=MODEL, filename="config.json", revision="v9"),
            hf_errors.RevisionNotFoundError,
        ),
        ("missing file", dict(repo_id=MODEL, filename="nope.json"), hf_errors.RemoteEntryNotFoundError),
    ]:
        # A fresh cache each: the client answers from its cache when the hub refuses.
        op(
            f"hf_hub_download ({name})",
            lambda kw=kw: hh.hf_hub_download(**kw, cache_dir=tempfile.mkdtemp(dir=os.environ["HF_HOME"])),
            expect_error=err,
            **kw,
        )

    data = FIXTURES / "data"
    for filename, local in [
        ("data/train.jsonl", data / "messages.jsonl"),
        ("data/train.parquet", data / "messages.parquet"),
    ]:
        op(
            "hf_hub_download",
            download(DATASET, filename, local.read_bytes(), repo_type="dataset"),
            repo_id=DATASET,
            repo_type="dataset",
            filename=filename,
        )

    def dataset_listing():
        info = api.dataset_info(DATASET, revision="main")
        files = sorted(s.rfilename for s in info.siblings)
        want = ["data/text.jsonl", "data/train.jsonl", "data/train.parquet"]
        assert files == want, files
        return {"sha": info.sha, "files": files}

    op("dataset_info", dataset_listing, repo_id=DATASET, revision="main")
    sharded = FIXTURES / "hub_datasets" / "sharded"
    v1 = {
        p.relative_to(sharded).as_posix(): p.read_bytes()
        for p in sorted(sharded.rglob("*"))
        if p.is_file()
        and (not p.name.startswith("train-0000") or p.name.startswith("train-00000"))
    }
    op(
        "snapshot_download",
        snapshot(SHARDED, v1, repo_type="dataset", revision="v1"),
        repo_id=SHARDED,
        repo_type="dataset",
        revision="v1",
    )

    import platform

    return {
        "made_by": "scripts/make_hub_client_fixtures.py",
        "client": {
            "huggingface_hub": hh.__version__,
            "httpx2": httpx2.__version__,
            "python": platform.python_version(),
            "env": {"HF_HUB_DISABLE_XET": "1"},
        },
        "token": TOKEN,
        "operations": operations,
        "exchanges": exchanges,
    }


if __name__ == "__main__":
    main()
