#!/usr/bin/env bash
# Build .whl/: the Python packages shardwise's GPU smoke test (python -m shardwise.smoke) needs that the
# device machine's image lacks (it holds torch 2.11+cu130, transformers, peft, accelerate, ninja, nvcc,
# but no deepspeed, bitsandbytes, jsonargparse or datasets), as wheels for CPython 3.12 on x86-64 Linux.
# Nothing can be downloaded there, so the folder travels with the run (carry [".whl"]); it must stay
# well under the 64 MiB that travels, working tree included. Versions are constraints.txt's, so the GPU
# run tests what the CPU suite tests. docs/launching.md ("GPU smoke test") has the run command.
#
#   tools/gpu_wheels.sh            # (re)build .whl/ at the repository root
#
# DeepSpeed is an sdist: built here with DS_BUILD_OPS=0 (pure Python; its ops, cpu_adam for the
# offload check, are JIT-built on the device with its nvcc and ninja). bitsandbytes' manylinux wheel
# carries one library per CUDA version (~10 of them); only CUDA 13's (torch 2.11+cu130) and the CPU
# one are kept, and RECORD is rewritten to match.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
OUT=.whl
# The folder travels only through carry, never in a commit: ignored locally, not in .gitignore.
grep -qxF "/$OUT/" .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo "/$OUT/" >> .git/info/exclude; }
rm -rf "$OUT" && mkdir -p "$OUT"

pin() {  # the version constraints.txt pins (names compared as pip does: case, - and _ alike)
    local want; want=$(echo "$1" | tr 'A-Z_' 'a-z-')
    awk -F'==' -v w="$want" '{n=tolower($1); gsub("_","-",n); if (n==w) print $2}' constraints.txt
}
spec() { local v; v=$(pin "$1"); [ -n "$v" ] || { echo "no pin for $1 in constraints.txt" >&2; exit 1; }; echo "$1==$v"; }

PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
download() {  # binary wheels for the device's interpreter, without dependencies (each is named here)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${PLATFORMS[@]}" -d "$OUT" "$@"
}

# deepspeed and what it imports that the image lacks (pydantic 2 and its parts; hjson). typing_extensions:
# pydantic needs >= 4.16, newer than torch's image may hold.
DS_BUILD_OPS=0 DS_ACCELERATOR=cuda python3 -m pip wheel -q --no-deps --no-build-isolation -w "$OUT" "$(spec deepspeed)"
download "$(spec hjson)" "$(spec pydantic)" "$(spec pydantic_core)" "$(spec annotated-types)" \
    "$(spec typing-inspection)" "$(spec typing_extensions)"
# jsonargparse (shardwise's CLI, imported by recipes and scaling) with its [signatures] extras.
download "$(spec jsonargparse)" "$(spec docstring_parser)" "$(spec typeshed_client)"
# datasets (the recipe's loader) and the two of its needs the image lacks.
download "$(spec datasets)" "$(spec dill)" "$(spec multiprocess)"
download "$(spec bitsandbytes)"

# bitsandbytes: keep libbitsandbytes_cpu and the CUDA 13.0 library (torch.version.cuda is "13.0" there).
python3 - "$OUT" <<'PY'
import base64, csv, glob, hashlib, io, os, re, sys, zipfile
(path,) = glob.glob(os.path.join(sys.argv[1], "bitsandbytes-*.whl"))
keep = re.compile(r"libbitsandbytes_(cpu|cuda130)\.so$")
drop = lambda name: re.search(r"libbitsandbytes_\w+\.(so|dll|dylib)$", name) and not keep.search(name)
tmp = path + ".tmp"
with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
    record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
    kept = [n for n in src.namelist() if not drop(n) and n != record]
    if not any(keep.search(n) and "cuda130" in n for n in kept):
        sys.exit(f"{path}: no libbitsandbytes_cuda130.so in the wheel; pick a bitsandbytes built for CUDA 13")
    rows = []
    for name in kept:
        data = src.read(name)
        dst.writestr(src.getinfo(name), data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append([name, f"sha256={digest}", str(len(data))])
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(rows + [[record, "", ""]])
    dst.writestr(record, out.getvalue())
os.replace(tmp, path)
PY

ls -la "$OUT"
du -sh "$OUT"
size=$(du -sm "$OUT" | cut -f1)
[ "$size" -le 40 ] || { echo "$OUT is ${size} MiB: over the 40 MiB this folder may take of the 64 MiB that travels" >&2; exit 1; }
