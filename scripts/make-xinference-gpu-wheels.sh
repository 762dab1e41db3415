#!/usr/bin/env bash
# Wheels that carry Xinference 3.5.0 to the GPU machine (CPython 3.12, no network there),
# next to the vLLM bundle (.vbundle) and xoscar (.whl):
#
#   echo /.xinfwhl/ >> .git/info/exclude && bash scripts/make-xinference-gpu-wheels.sh .xinfwhl
#
# Only what the GPU image and the vLLM bundle lack (found by recording the modules every
# process of a CPU xinference-local launch imported, tests/test_xinference_local.py).  The
# xinference wheel is repacked without the data files under xinference/thirdparty/ (46 of
# its 55 MB: fonts, checkpoints, vocabularies of other model families; their .py files
# stay, some are imported at start), so that the working tree fits a device call's 64 MiB.
# Used by scripts/gpu-xinference-local.sh.
set -euo pipefail
out=${1:-.xinfwhl}
mkdir -p "$out"
py=${PYTHON:-python3}
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64)
dl() { "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
         --implementation cp "${plat[@]}" -d "$out" "$@"; }
dl xinference==3.5.0 uvicorn==0.54.0 sse-starlette==3.7.0 python-multipart==0.0.34 \
   orjson==3.13.0 python-jose==3.5.0 ecdsa==0.19.2 rsa==4.9.1 pyasn1==0.6.5 bcrypt==5.0.0 \
   aioprometheus==23.12.0 async-timeout==5.0.1 cryptography==46.0.3 cffi==2.0.0 \
   pycparser==2.23 click==8.1.8
# quantile-python (aioprometheus) is published as an sdist only: build its pure wheel here
"$py" -m pip wheel -q --no-deps -w "$out" quantile-python==1.1
"$py" - "$out" <<'PY'
import glob, os, sys, zipfile
out = sys.argv[1]
src = glob.glob(os.path.join(out, "xinference-3.5.0-py3-none-any.whl"))[0]
tmp = src + ".trim"
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    for item in zin.infolist():
        name = item.filename
        if name.startswith("xinference/thirdparty/") and not name.endswith(".py"):
            continue
        data = zin.read(name)
        if name.endswith(".dist-info/RECORD"):
            data = b"".join(line + b"\n" for line in data.splitlines()
                            if not line.startswith(b"xinference/thirdparty/")
                            or line.split(b",")[0].endswith(b".py"))
        zout.writestr(item, data)
os.replace(tmp, src)
PY
du -ch "$out"/*.whl | tail -1
