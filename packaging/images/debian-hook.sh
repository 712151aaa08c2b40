#!/bin/sh
# mmdebstrap --customize-hook for the images' Debian root ($1), run as root by build.py.
# What Istio's base image (docker/Dockerfile.base) adds to its distribution: the proxy's user.
set -eu
root=$1

# istio-proxy, uid and gid 1337: the injector runs istio-proxy as 1337:1337 and istio-init as root,
# both from the proxy image, so the image has the user but keeps root as its default (as Istio's).
chroot "$root" groupadd --gid 1337 istio-proxy
chroot "$root" useradd --uid 1337 --gid 1337 --create-home --shell /bin/sh istio-proxy

# mmdebstrap leaves the build host's resolv.conf and hostname behind; the runtime provides all three.
: >"$root/etc/resolv.conf"
: >"$root/etc/hostname"
printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$root/etc/hosts"
