#!/usr/bin/env bash
# Build ASTRA-sim's analytical backend (the simulator simulate.py runs) from a pinned upstream commit or a local tree.
set -euo pipefail

REPO_URL="https://github.com/astra-sim/astra-sim.git"
PINNED_COMMIT="518bd513ae110428cd62eb60efc0f3993fd53c70"   # astra-sim main of 2026-03-25, the one simulate.py was tested with
BINARY_NAME="AstraSim_Analytical_Congestion_Unaware"
# The submodules the analytical backend compiles (ns-3 and htsim are other backends, hundreds of MB: not fetched).
SUBMODULES="extern/graph_frontend/chakra extern/network_backend/analytical extern/remote_memory_backend/analytical extern/helper/fmt extern/helper/spdlog"
PREFIX="${ASTRA_SIM_PREFIX:-$HOME/.local/astra-sim}"
SOURCE=""
YAML_CPP=""
JOBS=""
DRY_RUN=0
FORCE=0
MARKER_NAME=".mosim-astra-sim-source"

usage() {
    cat <<EOF
Build ASTRA-sim's analytical backend (congestion unaware), the simulator that simulate.py runs.

Usage: ./install_astra_sim.sh [--prefix DIR] [--source DIR [--yaml-cpp DIR]] [--jobs N] [--force] [--dry-run]

Options:
  --prefix DIR     where it goes: DIR/src (the sources), DIR/build, DIR/bin/$BINARY_NAME
                   (default: \$ASTRA_SIM_PREFIX or ~/.local/astra-sim)
  --source DIR     build from this ASTRA-sim tree with its submodules instead of cloning (offline); it is copied
                   to DIR/src of the prefix, never changed
  --yaml-cpp DIR   a yaml-cpp source tree for CMake's FetchContent when offline (default: the tree's
                   extern/helper/yaml-cpp when there is one; otherwise CMake downloads yaml-cpp)
  --jobs N         parallel compile jobs (default: the CPU count, at most 16)
  --force          build again even when the prefix already has this source built
  --dry-run        say what would be done and exit, changing nothing
  -h, --help       this help

Without --source it runs git clone $REPO_URL, checks out
${PINNED_COMMIT:0:12} and fetches the submodules the analytical backend needs. Needs git, cmake, a C++17
compiler and protobuf (Debian/Ubuntu: sudo apt-get install -y git cmake g++ protobuf-compiler libprotobuf-dev).
Compatibility fixes are applied only where the tree needs them (newer chakra or analytical submodules than the
pinned ones). Takes 10 to 20 minutes on 2 cores. Prints the export ASTRA_SIM=... line that simulate.py reads.
Exit status: 0 built (or already built); 1 the build failed; 2 bad usage.
EOF
}

usage_error() {  # one line, as the Python command lines refuse theirs: the help would push it off screen
    echo "error: $1 (see ./install_astra_sim.sh --help)" >&2
    exit 2
}

die() {
    echo "error: $1" >&2
    exit 1
}

say() { echo "==> $*"; }

# Runs a command, or only prints it under --dry-run.
step() {
    if [ "$DRY_RUN" = 1 ]; then
        echo "would run: $*"
    else
        "$@"
    fi
}

require_tools() {
    local missing="" tool
    for tool in "$@"; do
        command -v "$tool" >/dev/null 2>&1 || missing="$missing $tool"
    done
    if [ -n "$missing" ]; then
        die "not installed:$missing (Debian/Ubuntu: sudo apt-get install -y git cmake g++ protobuf-compiler libprotobuf-dev)"
    fi
}

# A tree has what the analytical backend compiles: each submodule with files in it.
check_tree() {
    local tree="$1" what="$2" path
    [ -f "$tree/build/astra_analytical/CMakeLists.txt" ] ||
        die "$what $tree: not an ASTRA-sim tree (no build/astra_analytical/CMakeLists.txt)"
    for path in $SUBMODULES; do
        if [ -z "$(ls -A "$tree/$path" 2>/dev/null)" ]; then
            die "$what $tree: $path is empty (a clone without submodules? run: git submodule update --init --recursive)"
        fi
    done
    [ -f "$tree/extern/graph_frontend/chakra/schema/protobuf/et_def.proto" ] ||
        die "$what $tree: extern/graph_frontend/chakra has no schema/protobuf/et_def.proto"
    # Two look-alikes build for minutes before failing: astra-sim/chakra's main branch has no feeder_v3 (ASTRA-sim's
    # pinned chakra commit, and that fork's stage branch, have it), and astra-sim/analytical is not the
    # astra-network-analytical repository the submodule names.
    [ -f "$tree/extern/graph_frontend/chakra/src/feeder_v3/et_feeder.h" ] ||
        die "$what $tree: extern/graph_frontend/chakra has no src/feeder_v3/et_feeder.h (a chakra without the feeder ASTRA-sim reads: check out the commit the tree pins)"
    [ -d "$tree/extern/network_backend/analytical/include/astra-network-analytical" ] ||
        die "$what $tree: extern/network_backend/analytical has no include/astra-network-analytical (not astra-sim/astra-network-analytical, the repository the submodule names)"
}

# $1 as an absolute path, whether or not it exists yet (its nearest existing folder resolved as cd resolves it).
absolute_path() {
    local path="$1" rest=""
    while [ ! -d "$path" ]; do
        rest="/$(basename "$path")$rest"
        path="$(dirname "$path")"
    done
    echo "$(cd "$path" && pwd)$rest"
}

# True when folder $1 is folder $2 or lies under it (both absolute).
is_within() {
    case "$1/" in "$2"/*) return 0 ;; *) return 1 ;; esac
}

# True when `using NAME = FeederV3::NAME;` is declared in namespace Chakra (after FeederV3 closes) in a header.
has_chakra_alias() {
    local name="$1" header
    shift
    for header in "$@"; do
        [ -f "$header" ] || continue
        if awk -v line="using $name = FeederV3::$name;" '
            /^}[[:space:]]*\/\/[[:space:]]*namespace FeederV3/ { outside = 1 }
            outside && index($0, line) { found = 1 }
            END { exit !found }' "$header"; then
            return 0
        fi
    done
    return 1
}

# Newer chakra forks moved the feeder into Chakra::FeederV3 while ASTRA-sim still names Chakra::ETFeeder(Node).
fix_feeder_aliases() {
    local tree="$1"
    local feeder="$tree/extern/graph_frontend/chakra/src/feeder_v3"
    local header="$feeder/et_feeder.h" name aliases=""
    [ -f "$header" ] || return 0
    for name in ETFeeder ETFeederNode; do
        if grep -rqw "Chakra::$name" "$tree/astra-sim" && ! has_chakra_alias "$name" "$header" "$feeder/et_feeder_node.h"; then
            aliases="$aliases $name"
        fi
    done
    [ -n "$aliases" ] || return 0
    say "Fix: declaring${aliases} in namespace Chakra (chakra's feeder_v3/et_feeder.h)"
    [ "$DRY_RUN" = 1 ] && return 0
    local tmp="$header.tmp.$$"
    awk -v names="$aliases" '
        /^}[[:space:]]*\/\/[[:space:]]*namespace Chakra/ && !done {
            n = split(names, list, " ")
            for (i = 1; i <= n; i++) print "using " list[i] " = FeederV3::" list[i] ";"
            done = 1
        }
        { print }' "$header" >"$tmp"
    mv "$tmp" "$header"
}

# The analytical backend adds extern/yaml-cpp as a subdirectory; ASTRA-sim itself brings yaml-cpp with FetchContent,
# so an empty submodule folder (a snapshot without it) only needs a CMakeLists.txt that adds nothing.
fix_empty_yaml_cpp() {
    local dir="$1/extern/network_backend/analytical/extern/yaml-cpp"
    if grep -q "extern/yaml-cpp" "$1/extern/network_backend/analytical/CMakeLists.txt" && [ ! -f "$dir/CMakeLists.txt" ]; then
        say "Fix: empty CMakeLists.txt in the analytical backend's extern/yaml-cpp (yaml-cpp comes from FetchContent)"
        [ "$DRY_RUN" = 1 ] && return 0
        mkdir -p "$dir"
        : >"$dir/CMakeLists.txt"
    fi
}

fetch_sources() {
    local src="$1"
    say "Cloning $REPO_URL at ${PINNED_COMMIT:0:12} into $src"
    # A stalled download stops instead of hanging a machine without network.
    export GIT_TERMINAL_PROMPT=0 GIT_HTTP_LOW_SPEED_LIMIT=1000 GIT_HTTP_LOW_SPEED_TIME=60
    # shellcheck disable=SC2086  # the submodule list is split on purpose
    if ! step git clone "$REPO_URL" "$src" ||
       ! step git -C "$src" checkout --quiet "$PINNED_COMMIT" ||
       ! step git -C "$src" submodule update --init --recursive -- $SUBMODULES; then
        die "could not clone $REPO_URL at $PINNED_COMMIT (no network?); offline, pass --source DIR with an ASTRA-sim tree and its submodules"
    fi
}

copy_sources() {
    local from="$1" src="$2"
    say "Copying $from to $src"
    step mkdir -p "$src"
    if [ "$DRY_RUN" = 1 ]; then
        echo "would run: tar -C $from --exclude=./.git --exclude=./build/astra_analytical/build -cf - . | tar -C $src -xf -"
        return
    fi
    tar -C "$from" --exclude=./.git --exclude=./build/astra_analytical/build -cf - . | tar -C "$src" -xf -
}

# The tree being built, to recognise an install that is already done: the pinned commit, or a --source tree with a
# checksum of its files (what copy_sources copies), so a tree edited since the last build (a patch applied, a
# submodule updated, uncommitted or not in git at all) is built again instead of reused. A --yaml-cpp tree outside
# the --source tree is compiled into the binary too, so its checksum is part of the description.
describe_source() {
    local described
    if [ -z "$SOURCE" ]; then
        described="$REPO_URL@$PINNED_COMMIT"
    else
        described="$SOURCE (files checksum $(tree_checksum "$SOURCE"))"
    fi
    if [ -n "$YAML_CPP" ] && { [ -z "$SOURCE" ] || ! is_within "$YAML_CPP" "$SOURCE"; }; then
        described="$described with yaml-cpp $YAML_CPP (files checksum $(tree_checksum "$YAML_CPP"))"
    fi
    echo "$described"
}

tree_checksum() {
    (cd "$1" && find . \( -path ./.git -o -path ./build/astra_analytical/build \) -prune -o -type f -print |
        LC_ALL=C sort | tr '\n' '\0' | xargs -0 cksum | cksum | cut -d' ' -f1)
}

main() {
    while [ $# -gt 0 ]; do
        case "$1" in
            --prefix|--source|--yaml-cpp|--jobs)
                # An empty value would mean the default (--source= would clone), an option would be taken as the
                # value (--prefix --dry-run would build into ./--dry-run).
                [ $# -ge 2 ] && [ -n "$2" ] || usage_error "$1 needs a value"
                [ "${2#-}" = "$2" ] || usage_error "$1 needs a value (got the option $2)"
                case "$1" in
                    --prefix) PREFIX="$2" ;;
                    --source) SOURCE="$2" ;;
                    --yaml-cpp) YAML_CPP="$2" ;;
                    --jobs) JOBS="$2" ;;
                esac
                shift 2 ;;
            --prefix=*|--source=*|--yaml-cpp=*|--jobs=*)
                [ -n "${1#*=}" ] || usage_error "${1%%=*} needs a value"
                case "$1" in
                    --prefix=*) PREFIX="${1#*=}" ;;
                    --source=*) SOURCE="${1#*=}" ;;
                    --yaml-cpp=*) YAML_CPP="${1#*=}" ;;
                    --jobs=*) JOBS="${1#*=}" ;;
                esac
                shift ;;
            --force) FORCE=1; shift ;;
            --dry-run) DRY_RUN=1; shift ;;
            -h|--help) usage; exit 0 ;;
            *) usage_error "unknown option: $1" ;;
        esac
    done
    if [ -n "$JOBS" ] && ! [[ "$JOBS" =~ ^[1-9][0-9]*$ ]]; then
        usage_error "--jobs $JOBS: not a positive whole number"
    fi
    [ -n "$PREFIX" ] || usage_error "--prefix needs a folder"
    # A file where the prefix or a folder above it goes: --dry-run had said it would build, the build could not
    # make the folder.
    local existing="$PREFIX"
    while [ ! -e "$existing" ] && [ ! -L "$existing" ]; do existing="$(dirname "$existing")"; done
    if [ ! -d "$existing" ]; then
        usage_error "--prefix $PREFIX: $existing is a file, not a folder"
    fi
    if [ -n "$SOURCE" ]; then
        [ -e "$SOURCE" ] || usage_error "--source $SOURCE: no such folder"
        [ -d "$SOURCE" ] || usage_error "--source $SOURCE: a file, not a folder (an ASTRA-sim source tree)"
        SOURCE="$(cd "$SOURCE" && pwd)"
        check_tree "$SOURCE" "--source"
        if [ -z "$YAML_CPP" ] && [ -f "$SOURCE/extern/helper/yaml-cpp/CMakeLists.txt" ]; then
            YAML_CPP="$SOURCE/extern/helper/yaml-cpp"
        fi
    fi
    if [ -n "$YAML_CPP" ]; then
        [ -f "$YAML_CPP/CMakeLists.txt" ] || usage_error "--yaml-cpp $YAML_CPP: not a yaml-cpp source tree (no CMakeLists.txt)"
        YAML_CPP="$(cd "$YAML_CPP" && pwd)"
    fi
    if [ -z "$JOBS" ]; then
        JOBS="$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 2)"
        [ "$JOBS" -le 16 ] || JOBS=16
    fi
    # A build deletes the prefix's src/ and copies the tree there: a tree in src/ would be gone before it is copied,
    # and a prefix inside the tree would be copied into itself.
    local absolute_prefix
    absolute_prefix="$(absolute_path "$PREFIX")"
    if [ -n "$SOURCE" ] && is_within "$absolute_prefix" "$SOURCE"; then
        usage_error "--prefix $PREFIX is inside --source $SOURCE (the tree would be copied into itself); pass a --prefix outside it"
    fi
    if [ -n "$SOURCE" ] && is_within "$SOURCE" "$absolute_prefix/src"; then
        usage_error "--source $SOURCE is inside $absolute_prefix/src, which a build deletes before copying the tree there; copy the tree elsewhere or pass another --prefix"
    fi
    if [ -n "$YAML_CPP" ] && is_within "$YAML_CPP" "$absolute_prefix/src"; then
        usage_error "--yaml-cpp $YAML_CPP is inside $absolute_prefix/src, which a build deletes; copy it elsewhere or pass another --prefix"
    fi
    if [ "$DRY_RUN" = 0 ]; then
        mkdir -p "$PREFIX" 2>/dev/null || die "--prefix $PREFIX: cannot create the folder"
    fi
    if [ -d "$PREFIX" ]; then
        PREFIX="$(cd "$PREFIX" && pwd)"
    fi
    local src="$PREFIX/src" build="$PREFIX/build" binary="$PREFIX/bin/$BINARY_NAME"
    local wanted
    wanted="$(describe_source)"
    if [ "$FORCE" = 0 ] && [ -x "$binary" ] && [ "$(cat "$PREFIX/$MARKER_NAME" 2>/dev/null)" = "$wanted" ]; then
        say "Reusing $binary (built from $wanted; --force builds again)"
        echo "export ASTRA_SIM=$binary"
        exit 0
    fi
    if [ "$DRY_RUN" = 1 ]; then
        say "Dry run: nothing is changed (would build $wanted)"
    else
        require_tools cmake c++ protoc
        [ -n "$SOURCE" ] || require_tools git
    fi
    if [ -e "$src" ] && [ "$DRY_RUN" = 0 ]; then
        say "Removing the earlier sources in $src"
        rm -rf "$src"
    fi
    local tree="$src"   # the tree the fixes look at: under --dry-run the original, as nothing is copied
    if [ -n "$SOURCE" ]; then
        copy_sources "$SOURCE" "$src"
        [ "$DRY_RUN" = 0 ] || tree="$SOURCE"
    else
        fetch_sources "$src"
    fi
    if [ -d "$tree" ]; then
        fix_feeder_aliases "$tree"
        fix_empty_yaml_cpp "$tree"
    fi
    local proto_dir="$src/extern/graph_frontend/chakra/schema/protobuf"
    say "Generating et_def.pb.cc from chakra's et_def.proto"
    step protoc et_def.proto --proto_path="$proto_dir" --cpp_out="$proto_dir"
    local -a configure=(cmake -S "$src/build/astra_analytical" -B "$build" -DCMAKE_BUILD_TYPE=Release
                        -DBUILDTARGET=congestion_unaware)
    if [ -n "$YAML_CPP" ]; then
        # Offline: CMake's FetchContent takes yaml-cpp from this tree instead of GitHub.
        configure+=("-DFETCHCONTENT_SOURCE_DIR_YAML-CPP=$YAML_CPP" -DFETCHCONTENT_FULLY_DISCONNECTED=ON)
    fi
    say "Configuring and building with $JOBS jobs (10 to 20 minutes on 2 cores)"
    step "${configure[@]}" || die "cmake could not configure $src (see above)"
    step cmake --build "$build" -j "$JOBS" --target AstraSim_Analytical_Congestion_Unaware ||
        die "the build failed (see above)"
    step mkdir -p "$PREFIX/bin"
    step cp "$build/bin/$BINARY_NAME" "$binary"
    if [ "$DRY_RUN" = 0 ]; then
        smoke_test "$src" "$binary"
        echo "$wanted" >"$PREFIX/$MARKER_NAME"
    fi
    if [ "$DRY_RUN" = 1 ]; then
        say "Dry run done: nothing was built; without --dry-run the binary would be $binary"
        return 0
    fi
    say "ASTRA-sim ready: $binary"
    echo "export ASTRA_SIM=$binary"
}

# ASTRA-sim's own 4-NPU all-reduce example: the binary runs and every NPU finishes.
smoke_test() {
    local src="$1" binary="$2" examples="$1/examples" out
    [ -d "$examples/workload/microbenchmarks/all_reduce/4npus_1MB" ] || return 0
    say "Checking it on ASTRA-sim's 4-NPU all-reduce example"
    out="$(cd "$PREFIX" && "$binary" \
        --workload-configuration="$examples/workload/microbenchmarks/all_reduce/4npus_1MB/all_reduce" \
        --system-configuration="$examples/system/native_collectives/Ring_4chunks.json" \
        --network-configuration="$examples/network/analytical/Ring_4npus.yml" \
        --remote-memory-configuration="$examples/remote_memory/analytical/no_memory_expansion.json" \
        --logging-folder="$PREFIX/log" 2>&1)" || die "$binary failed on the all-reduce example: $(echo "$out" | tail -n 1)"
    echo "$out" | grep -q "sys\[3\] finished" || die "$binary ran the all-reduce example but NPU 3 never finished"
    echo "$out" | grep "sys\[0\] finished" || true
}

main "$@"
