#!/usr/bin/env bash
# genai-perf in its own environment: bash loadtest/genai_perf/install.sh VENV PYTHON (what `make genai-perf-venv` runs).
#
# genai-perf drives perf_analyzer, whose only wheel on PyPI (perf-analyzer 2.60.0) is built for glibc 2.38. On an
# older glibc (Debian 12 has 2.36) the wheel is installed for that platform anyway, and VENV/bin/perf_analyzer runs
# it under Debian trixie's own C and C++ runtime (libc6, libstdc++6, libgcc-s1, fetched with apt-get download from a
# private sources list, unpacked into VENV/trixie-runtime): the loader of that runtime, with its libraries first.
# Needs network to PyPI, and on glibc < 2.38 apt-get and dpkg-deb with network to a Debian mirror (DEBIAN_MIRROR).
# Exits non-zero with the reason on stderr when it cannot build the environment.
set -euo pipefail
venv="${1:-.venv-genai-perf}"
python="${2:-python3}"
here="$(cd "$(dirname "$0")" && pwd)"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
pa_version=2.60.0

test -x "$venv/bin/python" || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$here/requirements.txt"
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"

glibc="$(getconf GNU_LIBC_VERSION | awk '{print $2}')"
if [ "$(printf '%s\n2.38\n' "$glibc" | sort -V | head -n 1)" = 2.38 ]; then  # glibc 2.38 or newer: the plain wheel
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "perf-analyzer==$pa_version"
    exit 0
fi

for tool in apt-get dpkg-deb; do
    command -v "$tool" >/dev/null \
        || { echo "glibc $glibc < 2.38 and no $tool to fetch Debian trixie's runtime" >&2; exit 3; }
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform manylinux_2_38_x86_64 -d "$work/wheel" "perf-analyzer==$pa_version"
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --platform manylinux_2_38_x86_64 --upgrade --target "$site" "$work"/wheel/*.whl

# Debian trixie's runtime, with apt's lists kept apart from the machine's own.
apt_dir="$work/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$work/debs"
echo "deb $mirror trixie main" > "$apt_dir/sources.list"
apt_opts=(-o "Dir::Etc::sourcelist=$apt_dir/sources.list" -o "Dir::Etc::sourceparts=-"
          -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache" -o "APT::Get::List-Cleanup=0"
          -o "APT::Sandbox::User=root")  # the files are in a folder of our own, which apt's user cannot read
apt-get -q "${apt_opts[@]}" update >/dev/null
(cd "$work/debs" && apt-get -q "${apt_opts[@]}" download libc6 libstdc++6 libgcc-s1 >/dev/null)
runtime="$(cd "$venv" && pwd)/trixie-runtime"
rm -rf "$runtime"
for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$runtime"; done
libs="$runtime/usr/lib/x86_64-linux-gnu"
test -x "$libs/ld-linux-x86-64.so.2" || { echo "trixie's libc6 has no $libs/ld-linux-x86-64.so.2" >&2; exit 3; }

binary="$site/perf_analyzer/bin/perf_analyzer"
test -x "$binary" || { echo "perf-analyzer $pa_version has no $binary" >&2; exit 3; }
cat > "$venv/bin/perf_analyzer" <<WRAPPER
#!/bin/sh
# perf_analyzer (built for glibc 2.38) under Debian trixie's C and C++ runtime: loadtest/genai_perf/install.sh
exec "$libs/ld-linux-x86-64.so.2" --library-path "$libs:/lib/x86_64-linux-gnu" "$binary" "\$@"
WRAPPER
chmod +x "$venv/bin/perf_analyzer"
"$venv/bin/perf_analyzer" --version >/dev/null 2>&1 || "$venv/bin/perf_analyzer" --help >/dev/null 2>&1 \
    || { echo "perf_analyzer does not run under trixie's runtime" >&2; exit 3; }
