#!/usr/bin/env bash
# Proves that `pip install '.[gpu]'` resolves on a CUDA machine, without one: a dry run of pip's
# resolver against PyPI (nothing is installed), for this machine's platform and Python, which must be
# Linux x86_64 (deepspeed is a source archive, so pip cannot resolve for another platform). Prints the
# torch, vllm, triton, transformers, deepspeed and nvidia-* it picks, and fails if resolution fails or
# if torch, vllm or triton are not the versions setup.py pins (torch the CUDA wheel, not a +cpu one).
#
#   scripts/check_gpu_install.sh        (or: make check-gpu-install)
#
# Uses .venv/bin/python if present, else python3 (>= 3.10, pip >= 22.2); PYTHON=... overrides.
# INDEX_URL=... points it at a PyPI mirror. Needs only the package registry. From an index that serves
# wheel metadata on its own (PEP 658, as pypi.org does) pip fetches only that; from one that does not,
# it downloads whole wheels: about 4 GB (torch, vllm, triton, the CUDA libraries), about 70 s at
# 200 MB/s. Nothing is kept (--no-cache-dir).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
INDEX_URL=${INDEX_URL:-https://pypi.org/simple}

"$PYTHON" - <<'EOF'
import platform
import sys
from importlib.metadata import version

pip = tuple(int(x) for x in version("pip").split(".")[:2])
problems = []
if sys.version_info < (3, 10):
    problems.append(f"Python >= 3.10 needed, this is {platform.python_version()}")
if pip < (22, 2):
    problems.append(f"pip >= 22.2 needed (for --dry-run --report), this is {version('pip')}")
if (platform.system(), platform.machine()) != ("Linux", "x86_64"):
    problems.append(f"resolves for this machine's platform: Linux x86_64 needed, this is "
                    f"{platform.system()} {platform.machine()}")
if problems:
    sys.exit("check_gpu_install: " + "; ".join(problems))
EOF

report=$(mktemp "${TMPDIR:-/tmp}/gpu-install-report.XXXXXX.json")
log=$(mktemp "${TMPDIR:-/tmp}/gpu-install-log.XXXXXX.txt")
trap 'rm -f "$report" "$log"' EXIT

# What a CUDA machine with a stock pip resolves: no pip configuration file (PIP_CONFIG_FILE=/dev/null:
# no global, user or site file, so no local constraints, find-links or extra indexes), no PIP_*
# variables (--isolated), PyPI as the only index, nothing installed counted (--ignore-installed), no
# cache. Only the CA bundle and the timeout of the environment are kept (they change no resolution).
cmd=(env PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip --isolated install --dry-run --ignore-installed
     --no-cache-dir --disable-pip-version-check --index-url "$INDEX_URL" --report "$report"
     ${PIP_CERT:+--cert "$PIP_CERT"} ${PIP_DEFAULT_TIMEOUT:+--timeout "$PIP_DEFAULT_TIMEOUT"} '.[gpu]')
echo "\$ ${cmd[*]}"
echo "pip $("$PYTHON" -m pip --version | cut -d' ' -f2), Python $("$PYTHON" -c 'import platform; print(platform.python_version(), platform.system(), platform.machine())')"
start=$SECONDS
if ! "${cmd[@]}" >"$log" 2>&1; then
    grep -vE '^ *(Collecting|Downloading|Using cached) |━' "$log" | tail -n 30 || true
    echo "FAIL: pip could not resolve '.[gpu]' (after $((SECONDS - start)) s; the last lines of its output are above)"
    exit 1
fi
echo "resolved in $((SECONDS - start)) s"

"$PYTHON" - "$report" <<'EOF'
import ast
import collections
import json
import re
import sys
from urllib.parse import urlparse

# The expected versions: the pins in setup.py (torch in install_requires, vllm and triton in the gpu extra).
tree = ast.parse(open("setup.py").read())
call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}


def pin(name, reqs):
    found = [m.group(1) for r in reqs if (m := re.fullmatch(rf"{name}==([\w.]+)", r.split(";")[0].strip()))]
    if len(found) != 1:
        sys.exit(f"FAIL: setup.py should pin {name}==X exactly once, found {found}")
    return found[0]


expected = {"torch": pin("torch", kw["install_requires"]),
            "vllm": pin("vllm", kw["extras_require"]["gpu"]),
            "triton": pin("triton", kw["extras_require"]["gpu"])}

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
print("  downloaded from: " + ", ".join(f"{where} ({n})" for where, n in sorted(origins.items())))

errors = [f"{name} resolved to {ver.get(name)}, expected {want}" for name, want in expected.items()
          if ver.get(name) != want]
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
print("OK: '.[gpu]' resolves with torch {torch} (CUDA), vllm {vllm}, triton {triton}".format(**expected))
EOF
