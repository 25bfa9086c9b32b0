#!/usr/bin/env bash
# Proves that `pip install '.[gpu]'` resolves on a CUDA machine, without one: a dry run of pip's
# resolver against PyPI (nothing is installed), for this machine's platform and Python, which must be
# Linux x86_64 (deepspeed is a source archive, so pip cannot resolve for another platform). Prints the
# torch, vllm, triton, transformers, deepspeed and nvidia-* it picks, and fails if resolution fails or
# if torch, vllm or triton are outside the ranges setup.py declares (torch the CUDA wheel, not a +cpu
# one) or not at the end of them that is checked:
#
#   scripts/check_gpu_install.sh            the newest in range: vllm and triton at their upper ends
#   scripts/check_gpu_install.sh --lowest   a constraint vllm==<its lower end>, which must pull torch and
#                                           triton to their lower ends (the torch that vllm pins, and
#                                           that torch's triton)
#   make check-gpu-install                  both, one after the other
#
# Uses .venv/bin/python if present, else python3 (>= 3.10); PYTHON=... overrides. INDEX_URL=... points
# it at a PyPI mirror. Needs only the package registry; about a minute, a progress line every 10 s
# (PROGRESS_EVERY_S).
#
# Reads wheel metadata only, a few MB in all: each wheel's METADATA file where the index serves it beside
# the wheel (PEP 658, as the public index does), else the same file read out of the wheel by HTTP range requests
# (pip's --use-feature=fast-deps; for mirrors and proxies without PEP 658). pip >= 25.3 stops there in a
# dry run, where older pips download every wheel after resolving (about 4 GB: torch, vllm, triton, the
# CUDA libraries). With an older pip, pip 25.3 or newer is first fetched into the check's own temporary
# folder (about 2 MB) and run from there; the environment's pip is not touched. A whole wheel of 10 MB
# or more that pip starts to download (an index that allows neither) stops the check with one line.
#
# Nothing is left behind: pip's own temporary files go to the check's folder (TMPDIR), which is removed
# on exit, on Ctrl-C and on a kill (pip is stopped first); no cache (--no-cache-dir).
# CHECK_TIMEOUT_S (default 300) stops a check that hangs.
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
INDEX_URL=${INDEX_URL:-https://pypi.org/simple}
CHECK_TIMEOUT_S=${CHECK_TIMEOUT_S:-300}
PROGRESS_EVERY_S=${PROGRESS_EVERY_S:-10}
MIN_PIP=25.3  # the first pip whose --dry-run stops at the metadata, without downloading the wheels
case "${1:-}" in
    "") end=upper ;;
    --lowest) end=lower ;;
    *) echo "usage: $0 [--lowest]" >&2; exit 2 ;;
esac

"$PYTHON" - <<'EOF'
import platform
import sys

problems = []
if sys.version_info < (3, 10):
    problems.append(f"Python >= 3.10 needed, this is {platform.python_version()}")
if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
    problems.append(f"resolves for this machine's platform: Linux x86_64 needed, this is "
                    f"{platform.system()} {platform.machine()}")
if problems:
    sys.exit("check_gpu_install: " + "; ".join(problems))
EOF

work=$(mktemp -d "${TMPDIR:-/tmp}/gpu-install-check.XXXXXX")
pip_pid=
stop_pip() {  # pip and its children (a source build's backend): TERM, then KILL after 5 s
    if [[ -n "$pip_pid" ]] && kill -0 "$pip_pid" 2>/dev/null; then
        kill -TERM -- "-$pip_pid" 2>/dev/null || kill -TERM "$pip_pid" 2>/dev/null || true
        for _ in 1 2 3 4 5; do kill -0 "$pip_pid" 2>/dev/null || break; sleep 1; done
        kill -KILL -- "-$pip_pid" 2>/dev/null || kill -KILL "$pip_pid" 2>/dev/null || true
        wait "$pip_pid" 2>/dev/null || true
    fi
    pip_pid=
}
trap 'stop_pip; rm -rf "$work"' EXIT
trap 'echo "check_gpu_install: interrupted; nothing left behind"; exit 130' INT
trap 'exit 143' TERM
mkdir "$work/tmp"
export TMPDIR="$work/tmp"  # pip's temporary folders (source builds, downloads) go there too
report="$work/report.json"
log="$work/pip.log"

# setup.py's ranges for torch (install_requires), vllm and triton (the gpu extra), with their ends, for the
# check after resolving; with --lowest, the constraint that pins vllm to its lower end.
"$PYTHON" - "$work/ranges.json" "$end" "$work/constraints.txt" <<'EOF'
import ast
import json
import sys

try:
    from packaging.requirements import Requirement
except ImportError:  # a python3 without the package: pip's own copy
    from pip._vendor.packaging.requirements import Requirement

tree = ast.parse(open("setup.py").read())
call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}
ranges = {}
for name, reqs in (("torch", kw["install_requires"]), ("vllm", kw["extras_require"]["gpu"]),
                   ("triton", kw["extras_require"]["gpu"])):
    found = [(text, r) for text in reqs if (r := Requirement(text)).name.lower() == name]
    lower = [s.version for _, r in found for s in r.specifier if s.operator == ">="]
    upper = [s.version for _, r in found for s in r.specifier if s.operator == "<="]
    if len(found) != 1 or len(lower) != 1:
        sys.exit(f"check_gpu_install: setup.py should declare {name}>=X once, found {[t for t, _ in found]}")
    spec = found[0][0].split(";")[0][len(name):].strip()  # as written, e.g. ">=0.26.0,<=0.32.0"
    ranges[name] = {"spec": spec, "lower": lower[0], "upper": upper[0] if upper else None}
json.dump(ranges, open(sys.argv[1], "w"))
if sys.argv[2] == "lower":
    open(sys.argv[3], "w").write(f"vllm=={ranges['vllm']['lower']}\n")
EOF
constraint=()
if [[ "$end" == lower ]]; then
    constraint=(--constraint "$work/constraints.txt")
    echo "the lower end: constraint $(cat "$work/constraints.txt")"
fi

# A pip that reads metadata only: the environment's, if recent enough, else one fetched into $work.
pip=("$PYTHON" -m pip)
have=$("$PYTHON" -c 'from importlib.metadata import version; print(version("pip"))' 2>/dev/null || echo 0)
if ! "$PYTHON" -c 'import re, sys; v = [tuple(int(x) for x in re.findall(r"\d+", s)[:2]) for s in sys.argv[1:]]
sys.exit(v[0] < v[1])' "$have" "$MIN_PIP"; then
    echo "pip $have downloads every wheel in a dry run: fetching pip>=$MIN_PIP into $work (about 2 MB, removed at exit)"
    env PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip --isolated install --quiet --disable-pip-version-check \
        --no-cache-dir --index-url "$INDEX_URL" ${PIP_CERT:+--cert "$PIP_CERT"} --target "$work/pip" "pip>=$MIN_PIP"
    pip=(env "PYTHONPATH=$work/pip${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m pip)
fi

# What a CUDA machine with a stock pip resolves: no pip configuration file (PIP_CONFIG_FILE=/dev/null:
# no global, user or site file, so no local constraints, find-links or extra indexes), no PIP_*
# variables (--isolated), PyPI as the only index, nothing installed counted (--ignore-installed), no
# cache. Only the CA bundle and the timeout of the environment are kept (they change no resolution).
cmd=(env PIP_CONFIG_FILE=/dev/null "${pip[@]}" --isolated install --dry-run --ignore-installed
     --no-cache-dir --disable-pip-version-check --progress-bar off --use-feature=fast-deps --index-url "$INDEX_URL"
     --report "$report"
     ${PIP_CERT:+--cert "$PIP_CERT"} ${PIP_DEFAULT_TIMEOUT:+--timeout "$PIP_DEFAULT_TIMEOUT"} ${constraint[@]+"${constraint[@]}"}
     '.[gpu]')
echo "\$ ${cmd[*]}"
echo "pip $("${pip[@]}" --version | cut -d' ' -f2), Python $("$PYTHON" -c 'import platform; print(platform.python_version(), platform.system(), platform.machine())')"

# The first whole wheel of 10 MB or more in pip's log ("Downloading torch-2.13.0-...whl (527.3 MB)"; a
# metadata read is "Downloading torch-2.13.0-...whl.metadata (30 kB)"): its name and size, else nothing.
whole_wheel() {
    awk '$1 == "Downloading" && $2 ~ /\.whl$/ { size = $3; unit = $4; gsub(/[()]/, "", size); gsub(/[()]/, "", unit)
         if (unit == "GB" || (unit == "MB" && size + 0 >= 10)) { print $2 " (" size " " unit ")"; exit } }' "$log"
}

start=$SECONDS
: >"$log"  # before pip starts: the reads below may run before the background job has opened it
setsid "${cmd[@]}" >>"$log" 2>&1 </dev/null &  # its own process group: stop_pip ends its children too
pip_pid=$!
next=0
while kill -0 "$pip_pid" 2>/dev/null; do
    elapsed=$((SECONDS - start))
    wheel=$(whole_wheel)
    if [[ -n "$wheel" ]]; then
        stop_pip
        echo "FAIL: pip started downloading a whole wheel, $wheel, after $elapsed s: the index serves neither its" \
             "metadata (PEP 658) nor byte ranges of it, and this check reads metadata only; use the public index (the default INDEX_URL)"
        exit 1
    fi
    if ((elapsed >= CHECK_TIMEOUT_S)); then
        stop_pip
        echo "FAIL: pip had not resolved '.[gpu]' after $elapsed s (CHECK_TIMEOUT_S); the last lines of its output:"
        tail -n 5 "$log"
        exit 1
    fi
    if ((elapsed >= next)); then
        read -r count latest < <(awk '$1 == "Collecting" { n++; last = $2 } END { print n + 0, last }' "$log")
        echo "  ${elapsed} s: ${count} packages read${latest:+ (the latest: $latest)}"
        next=$((next + PROGRESS_EVERY_S))
    fi
    sleep 1
done
if wait "$pip_pid"; then status=0; else status=$?; fi
pip_pid=
if ((status != 0)); then
    grep -vE '^ *(Collecting|Downloading|Using cached|Obtaining) |━' "$log" | tail -n 30 || true
    echo "FAIL: pip could not resolve '.[gpu]' (after $((SECONDS - start)) s; the last lines of its output are above)"
    exit 1
fi
reads=$(grep -cE '^ *(Downloading .*\.metadata |Obtaining dependency information from )' "$log" || true)
echo "resolved in $((SECONDS - start)) s, from $reads wheels' metadata"

"$PYTHON" - "$report" "$work/ranges.json" "$end" <<'EOF'
import collections
import json
import sys
from urllib.parse import urlparse

try:
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
except ImportError:  # a python3 without the package: pip's own copy
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.version import Version

# setup.py's ranges (torch in install_requires, vllm and triton in the gpu extra) and the end checked.
ranges, end = json.load(open(sys.argv[2])), sys.argv[3]

report = json.load(open(sys.argv[1]))
env = report["environment"]
installs = {i["metadata"]["name"].lower().replace("_", "-"): i for i in report["install"]}
ver = {name: i["metadata"]["version"] for name, i in installs.items()}
url = {name: i["download_info"]["url"] for name, i in installs.items()}

print(f"resolved for Python {env['python_full_version']} on {env['sys_platform']} {env['platform_machine']}: "
      f"{len(installs)} packages")
for name in ("torch", "vllm", "triton", "transformers", "deepspeed"):
    print(f"  {name:13s} {ver.get(name, 'MISSING'):8s} {url.get(name, '').rsplit('/', 1)[-1]}")
nvidia = sorted(n for n in ver if n.startswith("nvidia-"))
print(f"  nvidia-* ({len(nvidia)}): " + ", ".join(f"{n}=={ver[n]}" for n in nvidia))
cuda = sorted(n for n in ver if n.startswith("cuda-"))
print(f"  cuda-* ({len(cuda)}): " + ", ".join(f"{n}=={ver[n]}" for n in cuda))
where = {n: urlparse(u).netloc or f"{urlparse(u).scheme}://" for n, u in url.items() if n != "fastrlhf"}
origins = collections.Counter(where.values())
print("  files on: " + ", ".join(f"{where} ({n})" for where, n in sorted(origins.items())))

errors = []
for name, declared in ranges.items():
    got, want = ver.get(name), declared[end]
    if got is None or not SpecifierSet(declared["spec"]).contains(got):
        errors.append(f"{name} resolved to {got}, outside setup.py's range {declared['spec']}")
    elif want is not None and Version(got).public != Version(want).public:
        errors.append(f"{name} resolved to {got}, not the {end} end of setup.py's range {declared['spec']} ({want})")
local = sorted(n for n, u in url.items() if n != "fastrlhf" and not u.startswith("https://"))
if local:
    shown = (["torch"] if "torch" in local else []) + [n for n in local if n != "torch"][:2]
    errors.append(f"{len(local)} packages not from the index, e.g. " + ", ".join(f"{n} ({url[n]})" for n in shown))
if not any(n.startswith("nvidia-nccl") for n in nvidia) or not any(n.startswith("nvidia-cudnn") for n in nvidia):
    errors.append("no nvidia-nccl/nvidia-cudnn wheels: that torch is not the CUDA build")
if "flash-attn" in ver:
    errors.append("flash-attn is in the resolution: it is a source archive whose build imports torch")
if errors:
    sys.exit("FAIL: " + "; ".join(errors))
print(f"OK: '.[gpu]' resolves with torch {ver['torch']} (CUDA), vllm {ver['vllm']}, triton {ver['triton']}: "
      f"the {end} end of setup.py's ranges")
EOF
