# Sourced by .ci/run and bin/chain: a virtual environment at .venv with the
# package installed (PEP 668: never into the system's Python), and Debian
# packages installed when a command is missing. As root, apt-get directly;
# otherwise through sudo. Usage: ensure_debs CMD:PACKAGE ...; ensure_venv EXTRAS.

ensure_debs() {
    local missing=() pair
    for pair in "$@"; do
        if ! command -v "${pair%%:*}" >/dev/null 2>&1; then
            missing+=("${pair#*:}")
        fi
    done
    if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
        missing+=(python3-venv)
    fi
    [ ${#missing[@]} -eq 0 ] && return 0
    local sudo=()
    if [ "$(id -u)" -ne 0 ]; then
        if ! command -v sudo >/dev/null 2>&1; then
            echo "error: missing Debian packages (${missing[*]}); install them as root: apt-get install ${missing[*]}" >&2
            exit 2
        fi
        sudo=(sudo)
    fi
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
}

ensure_venv() {
    local extras="${1:-}" stamp want
    if [ ! -x .venv/bin/python ]; then
        python3 -m venv .venv
    fi
    # Installed again only when pyproject.toml, the extras or the install mode change. The
    # "compat" editable mode puts the project's root on sys.path with a plain .pth file, which
    # type checkers follow: mypy --strict on a user's script finds blocks and its types.
    stamp=".venv/.proxyblocks-installed"
    want="$(cat pyproject.toml | sha256sum | cut -d' ' -f1) ${extras} compat"
    if [ ! -f "$stamp" ] || ! grep -qxF -- "$want" "$stamp"; then
        .venv/bin/python -m pip install --quiet --disable-pip-version-check \
            --config-settings editable_mode=compat -e ".${extras}"
        echo "$want" >>"$stamp"
    fi
}

ensure_python_headers() {
    # Python's headers, which the nghttp2 codec's C shim compiles against (Debian: python3-dev).
    if python3 -c 'import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then
        return 0
    fi
    local sudo=()
    [ "$(id -u)" -ne 0 ] && sudo=(sudo)
    "${sudo[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq python3-dev >/dev/null
}
