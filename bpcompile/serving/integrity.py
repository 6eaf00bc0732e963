"""Before tritonserver loads a repository: the engine versions it holds are checked against their manifests.

An emitted repository holds, per version N, a copy of (or, emitted with link=True, a link to) the engine version in
tensorrt_llm/N/engine/, manifest.json included, and copies of its tokenizer/ in preprocessing/N/ and
postprocessing/N/. Every one of those files is checked against the size and sha256 the build recorded
(core/store.py `verify_version`), so a tampered rank file or tokenizer is refused with exit 2 naming it, before
tritonserver starts. The Triton generator model checks its engine again when it loads it (Generator.from_engine),
which covers versions loaded later through the repository API; $BPCOMPILE_VERIFY=0 (`serve --no-verify` sets it)
skips both."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Union

from bpcompile.core.errors import UserError
from bpcompile.core.store import sha256_file, verify_enabled, verify_version

GENERATOR = "tensorrt_llm"  # serving/emit.py: the model that carries the engine version
TOKENIZER_COPIES = ("preprocessing", "postprocessing")


def verify_repository(repo_dir: Union[str, Path]) -> list[int]:
    """Check every engine version of an emitted repository (see the module docstring); the versions checked.
    UserError naming the first file that differs from its manifest."""
    repo = Path(repo_dir)
    gen = repo / GENERATOR
    versions = sorted(int(p.name) for p in gen.iterdir() if p.name.isdigit()) if gen.is_dir() else []
    for n in versions:
        engine = gen / str(n) / "engine"
        if not engine.is_dir():
            raise UserError(f"{GENERATOR}/{n} holds no engine/ to verify; re-emit the repository", file=str(repo))
        arts = verify_version(engine)["artifacts"]
        want = {rel[len("tokenizer/") :]: a for rel, a in arts.items() if rel.startswith("tokenizer/")}
        for model in TOKENIZER_COPIES:
            tok = repo / model / str(n) / "tokenizer"
            if not tok.is_dir():
                continue
            have = {str(f.relative_to(tok)) for f in tok.rglob("*") if f.is_file() or f.is_symlink()}
            for rel in sorted(have | want.keys()):
                where = f"{model}/{n}/tokenizer/{rel}"
                a = want.get(rel)
                if a is None or rel not in have:
                    why = "is not in the engine's manifest" if a is None else "is missing"
                    raise UserError(f"{repo}: {where} {why}; re-emit the repository")
                f = tok / rel
                what = (
                    "size"
                    if not f.is_file() or f.stat().st_size != a["bytes"]
                    else "sha256"
                    if sha256_file(f) != a["sha256"]
                    else None
                )
                if what:
                    raise UserError(
                        f"{repo}: {where}: its {what} differs from the engine manifest's tokenizer/{rel}; "
                        "re-emit the repository (or serve --no-verify)"
                    )
    return versions


def verify_before_serving(repo_dir: Union[str, Path], log=print) -> None:
    """`bpcompile serve`'s check, before tritonserver starts: verify_repository unless $BPCOMPILE_VERIFY is 0
    (`serve --no-verify`)."""
    if not verify_enabled():
        log("engine versions not verified (--no-verify)")
        return
    t0 = time.perf_counter()
    versions = verify_repository(repo_dir)
    took = time.perf_counter() - t0
    log(f"engine version(s) {', '.join(map(str, versions))}: files match their manifests ({took:.1f}s)")
