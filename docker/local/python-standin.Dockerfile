# A stand-in for python:3.11-slim, for machines that cannot pull it (made by docker/local/bases.sh,
# never by a user who can pull the official image).
# Its base is a debootstrap minbase of Debian bookworm imported with `docker import`; on it,
# Debian's Python 3.11 laid out as the official image lays it out: `python` and `pip` on the PATH,
# pip free to install into the system interpreter (no EXTERNALLY-MANAGED marker), and the build
# machine's CA bundle as the system bundle, since package downloads on such machines pass a TLS
# proxy that only that bundle trusts.
ARG ROOTFS
FROM ${ROOTFS}
ENV LANG=C.UTF-8 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    REQUESTS_CA_BUNDLE=/etc/ssl/certs/ca-certificates.crt \
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/* /usr/lib/python3*/EXTERNALLY-MANAGED \
 && ln -s /usr/bin/python3 /usr/local/bin/python \
 && ln -s /usr/bin/pip3 /usr/local/bin/pip
# After the packages: installing ca-certificates rewrites the system bundle.
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
CMD ["python3"]
