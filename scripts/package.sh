#!/usr/bin/env bash
# Builds every release artifact into dist/ (or --out DIR), with SHA256SUMS:
#
#   vramguard-<version>-x86_64-linux-gnu.tar.gz   stripped binary for glibc 2.17 and later, README,
#                                                 LICENSE, completions, man pages, systemd unit,
#                                                 example config
#   vramguard_<version>-1_amd64.deb               cargo-deb: /usr/bin, the unit (not enabled),
#   vramguard-<version>-1.x86_64.rpm              cargo-generate-rpm   /etc/vramguard/config.toml
#                                                 (conffile, 0644), man pages, completions, the
#                                                 audit log directory (0750), LICENSE; the rpm's
#                                                 payload is xz (rpm 4.11, RHEL/CentOS 7)
#   vramguard-<version>-py3-none-manylinux…whl    maturin: the binary on PATH plus the `vramguard`
#                                                 Python module, LICENSE in its dist-info
#   vramguard-<version>-oci.tar                   OCI image (buildah, no daemon): the binary, the
#                                                 C libraries it needs and ldconfig; entrypoint
#                                                 `vramguard`, tag vramguard:<version>
#
# One build serves them all: maturin compiles the binary with zig against glibc 2.17
# (manylinux2014), and the tarball, the packages and the image take that same file.
#
# Usage: scripts/package.sh [--quick] [--only tarball,deb,rpm,wheel,image] [--out DIR]
#   --quick  build without optimisation (profile dist-quick): the same artifacts, for the
#            test suite; not for release
#
# Installs what it needs when missing: Debian's buildah, rpm and binutils; ziglang and maturin in a
# venv in target/package-tools; cargo-deb and cargo-generate-rpm with `cargo install` (pinned).
set -euo pipefail
cd "$(dirname "$0")/.."

profile=dist
only="tarball,deb,rpm,wheel,image"
out=dist
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) profile=dist-quick ;;
        --only) only="$2"; shift ;;
        --out) out="$2"; shift ;;
        -h|--help) sed -n '2,25p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "scripts/package.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done
want() { [[ ",$only," == *",$1,"* ]]; }
for part in ${only//,/ }; do
    case "$part" in
        tarball|deb|rpm|wheel|image) ;;
        *) echo "scripts/package.sh: --only: unknown artifact $part (tarball, deb, rpm, wheel, image)" >&2; exit 2 ;;
    esac
done

version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
target=x86_64-unknown-linux-gnu
tools=target/package-tools
stage=target/package/stage
bin=target/$target/$profile/vramguard
say() { echo "package: $*" >&2; }

# --- tools ---------------------------------------------------------------------------------
need=()
command -v objdump >/dev/null 2>&1 || need+=(binutils)
if want rpm; then command -v rpmbuild >/dev/null 2>&1 || need+=(rpm); fi
if want image; then command -v buildah >/dev/null 2>&1 || need+=(buildah); fi
if [ ${#need[@]} -gt 0 ]; then
    say "installing ${need[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
py_tools="ziglang==0.17.1 maturin==1.16.0"
if [ ! -f "$tools/.tools" ] || [ "$(cat "$tools/.tools")" != "$py_tools" ]; then
    say "installing $py_tools into $tools"
    python3 -m venv "$tools"
    # shellcheck disable=SC2086
    "$tools/bin/pip" install -q $py_tools
    echo "$py_tools" > "$tools/.tools"
fi
export PATH="$PWD/$tools/bin:$PATH"
cargo_tool() { # NAME VERSION: `cargo install` once per machine, as any cargo subcommand.
    if ! "$1" --version 2>/dev/null | grep -qF "$2"; then
        say "installing $1 $2 (cargo install, once)"
        cargo install --locked --quiet "$1@$2"
    fi
}
cargo_home=${CARGO_HOME:-${HOME:-/root}/.cargo}
export PATH="$cargo_home/bin:$PATH"
if want deb; then cargo_tool cargo-deb 3.8.0; fi
if want rpm; then cargo_tool cargo-generate-rpm 0.21.1; fi

# --- the binary: built once, by maturin with zig, for glibc 2.17 -----------------------------
mkdir -p "$out"
say "building vramguard $version ($profile) for $target, glibc 2.17"
rm -f target/wheels/vramguard-*.whl
(cd packaging/python && maturin build --locked --quiet --zig --profile "$profile" \
    --target "$target" --compatibility manylinux2014 --out ../../target/wheels) >&2
highest=$(objdump -T "$bin" | grep -o 'GLIBC_[0-9.]*' | sed 's/GLIBC_//' | sort -V | tail -1)
if [ "$(printf '%s\n2.17\n' "$highest" | sort -V | tail -1)" != 2.17 ]; then
    echo "scripts/package.sh: $bin needs glibc $highest; it must run on 2.17" >&2
    exit 1
fi
say "the binary needs glibc $highest at most"

# --- what every package carries beside the binary -------------------------------------------
rm -rf "$stage"
mkdir -p "$stage/man" "$stage/completions"
"$bin" man --dir "$stage/man" >/dev/null
"$bin" completions bash > "$stage/completions/vramguard.bash"
"$bin" completions zsh > "$stage/completions/_vramguard"
"$bin" completions fish > "$stage/completions/vramguard.fish"
# Packages put the binary in /usr/bin; the tarball's unit keeps /usr/local/bin.
sed 's|/usr/local/bin/vramguard|/usr/bin/vramguard|g; s|^# Install: .*|# Installed by the vramguard package; enable with: systemctl enable --now vramguard-agent|' \
    deploy/systemd/vramguard-agent.service > "$stage/vramguard-agent.service"
printf '# The audit log of vramguard reclaim and the agent: root only.\nd /var/log/vramguard 0750 root root -\n' \
    > "$stage/vramguard.tmpfiles"

artifacts=()
if want wheel; then
    cp target/wheels/vramguard-"$version"-*.whl "$out/"
    artifacts+=("$(basename target/wheels/vramguard-"$version"-*.whl)")
fi

if want tarball; then
    name=vramguard-$version-x86_64-linux-gnu
    dir=target/package/$name
    rm -rf "$dir"
    mkdir -p "$dir/systemd"
    cp "$bin" README.md LICENSE docs/json-schema.md "$dir/"
    install -m 644 deploy/config.toml "$dir/config.toml.example"
    cp -r "$stage/man" "$stage/completions" "$dir/"
    cp deploy/systemd/vramguard-agent.service "$dir/systemd/"
    tar -C target/package --owner=0 --group=0 --numeric-owner -czf "$out/$name.tar.gz" "$name"
    artifacts+=("$name.tar.gz")
fi

if want deb; then
    deb=$(cargo deb --no-build --locked --quiet -p vramguard --target "$target" --profile "$profile" \
        --output "$out" 2>&1 | tail -1)
    artifacts+=("$(basename "$deb")")
fi

if want rpm; then
    rm -f "$out"/vramguard-*.rpm
    # xz, not cargo-generate-rpm's default zstd: rpm reads zstd payloads from 4.14 on, and
    # RHEL/CentOS 7 has 4.11.
    cargo generate-rpm -p crates/vramguard --target "$target" --profile "$profile" \
        --payload-compress xz -o "$out" >&2
    artifacts+=("$(basename "$(ls "$out"/vramguard-"$version"-*.rpm)")")
fi

if want image; then
    tag=vramguard:$version
    root=target/package/image-root
    rm -rf "$root"
    mkdir -p "$root/usr/bin" "$root/sbin" "$root/etc/vramguard" "$root/tmp" "$root/var/log/vramguard" \
        "$root/proc" "$root/dev" "$root/sys"
    chmod 1777 "$root/tmp"
    chmod 0750 "$root/var/log/vramguard"
    cp "$bin" "$root/usr/bin/vramguard"
    install -m 644 deploy/config.toml "$root/etc/vramguard/config.toml"
    install -D -m 644 LICENSE "$root/usr/share/doc/vramguard/LICENSE"
    # The C libraries the binary links, from this machine (no base image), and ldconfig: the
    # NVIDIA container toolkit runs the image's ldconfig after it mounts libnvidia-ml.so.1.
    for lib in $(ldd "$bin" | awk '/=>/ { print $3 } /ld-linux/ && !/=>/ { print $1 }'); do
        mkdir -p "$root$(dirname "$lib")"
        cp -L "$lib" "$root$lib"
    done
    cp /sbin/ldconfig "$root/sbin/ldconfig"
    printf '/usr/local/lib\n/lib/x86_64-linux-gnu\n/usr/lib/x86_64-linux-gnu\n/usr/lib64\n' > "$root/etc/ld.so.conf"
    printf 'root:x:0:0:root:/root:/usr/bin/vramguard\nnobody:x:65534:65534:nobody:/nonexistent:/usr/bin/vramguard\n' > "$root/etc/passwd"
    printf 'root:x:0:\nnogroup:x:65534:\n' > "$root/etc/group"
    rm -f "$out/vramguard-$version-oci.tar"
    # Storage of its own (vfs: no overlay mount needed), removed afterwards.
    storage=$(mktemp -d /tmp/vramguard-buildah.XXXXXX)
    trap 'rm -rf "$storage"' EXIT
    b() { buildah --root "$storage/root" --runroot "$storage/run" --storage-driver vfs "$@"; }
    ctr=$(b from --quiet scratch)
    b copy --quiet "$ctr" "$root/" / >/dev/null
    b config --entrypoint '["/usr/bin/vramguard"]' --cmd agent \
        --label "org.opencontainers.image.title=vramguard" \
        --label "org.opencontainers.image.version=$version" \
        --label "org.opencontainers.image.licenses=Apache-2.0" \
        --env PATH=/usr/bin:/sbin "$ctr"
    b commit --quiet --format oci "$ctr" "oci-archive:$out/vramguard-$version-oci.tar:$tag" >/dev/null
    b rm "$ctr" >/dev/null
    artifacts+=("vramguard-$version-oci.tar")
    say "image tag: $tag (load it with: podman load -i $out/vramguard-$version-oci.tar, or skopeo copy to your registry)"
fi

(cd "$out" && sha256sum "${artifacts[@]}" > SHA256SUMS)
say "artifacts in $out/:"
(cd "$out" && ls -l "${artifacts[@]}" SHA256SUMS) >&2
echo "image: vramguard:$version"
