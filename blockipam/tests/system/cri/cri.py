#!/usr/bin/python3
"""Drives containerd's CRI plugin over gRPC for blockipam/tests/system/cri.rs and daemonset.rs (the kubelet's path, without a kubelet).

Run with Debian's /usr/bin/python3 (python3-grpcio, python3-protobuf) and protoc (protobuf-compiler).

  cri.py stubs DIR                          generate the runtime.v1 message classes into DIR
  cri.py image TAR NAME COMMAND...          write a docker-archive image NAME whose rootfs is busybox-static
                                            (bin/busybox, bin/sh, bin/sleep) and whose command is COMMAND
  cri.py extract ARCHIVE PATH OUT           write the file PATH of the OCI image archive ARCHIVE (its top-most
                                            layer holding PATH) to OUT
  cri.py add-layer ARCHIVE OUT NAME PATH FILE
                                            write OUT: the OCI archive ARCHIVE with one more layer holding FILE
                                            at PATH (mode 0755), tagged NAME (a second image version)
  cri.py --stubs DIR --socket SOCK wait     wait (up to 30 s) for the CRI to answer Version; print it
  cri.py --stubs DIR --socket SOCK call METHOD REQUEST_JSON
                                            call runtime.v1.RuntimeService/METHOD with REQUEST_JSON (the
                                            proto3 JSON mapping of METHODRequest); print the response as JSON

Every failure exits non-zero with one line on stderr naming what failed (a gRPC error: its code and details).
cri-client/proto/api.proto is kubernetes/cri-api's pkg/apis/runtime/v1/api.proto, verbatim (see README.md);
`stubs` drops its gogoproto lines (an import and Go code-generation options only) before running protoc.
"""

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

HERE = os.path.dirname(os.path.abspath(__file__))
# The CRI proto, shared with the agent's CRI client (cri-client/build.rs generates it for Rust).
API_PROTO = os.path.join(HERE, "..", "..", "..", "..", "cri-client", "proto", "api.proto")
BUSYBOX = "/bin/busybox"


def fail(message):
    print(f"cri.py: {message}", file=sys.stderr)
    sys.exit(1)


def generate_stubs(directory):
    os.makedirs(directory, exist_ok=True)
    with open(API_PROTO, encoding="utf-8") as source:
        lines = [line for line in source if "gogoproto" not in line]
    with open(os.path.join(directory, "api.proto"), "w", encoding="utf-8") as target:
        target.writelines(lines)
    try:
        done = subprocess.run(
            ["protoc", f"-I{directory}", f"--python_out={directory}", "api.proto"],
            cwd=directory,
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:
        fail("protoc is missing: apt-get install protobuf-compiler")
    if done.returncode != 0:
        fail(f"protoc failed: {done.stderr.strip()}")


def tar_member(archive, name, data):
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    archive.addfile(info, io.BytesIO(data))


def write_image(path, name, command):
    if not os.path.isfile(BUSYBOX):
        fail(f"{BUSYBOX} is missing: apt-get install busybox-static")
    layer_bytes = io.BytesIO()
    with tarfile.open(fileobj=layer_bytes, mode="w", format=tarfile.PAX_FORMAT) as layer:
        directory = tarfile.TarInfo("bin")
        directory.type = tarfile.DIRTYPE
        directory.mode = 0o755
        layer.addfile(directory)
        with open(BUSYBOX, "rb") as busybox:
            data = busybox.read()
        binary = tarfile.TarInfo("bin/busybox")
        binary.size = len(data)
        binary.mode = 0o755
        layer.addfile(binary, io.BytesIO(data))
        for applet in ("sh", "sleep"):
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type = tarfile.SYMTYPE
            link.linkname = "busybox"
            link.mode = 0o777
            layer.addfile(link)
    layer_data = layer_bytes.getvalue()
    layer_digest = hashlib.sha256(layer_data).hexdigest()
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Cmd": command, "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]},
    }
    config_data = json.dumps(config).encode()
    config_name = hashlib.sha256(config_data).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": [name], "Layers": [f"{layer_digest}/layer.tar"]}]
    with tarfile.open(path, mode="w") as archive:
        tar_member(archive, f"{layer_digest}/layer.tar", layer_data)
        tar_member(archive, config_name, config_data)
        tar_member(archive, "manifest.json", json.dumps(manifest).encode())


def oci_blob(layout, digest):
    algorithm, value = digest.split(":", 1)
    return layout.extractfile(f"blobs/{algorithm}/{value}").read()


def oci_image(layout):
    index = json.loads(layout.extractfile("index.json").read())
    if len(index["manifests"]) != 1:
        fail(f"expected one image in the archive, found {len(index['manifests'])}")
    manifest = json.loads(oci_blob(layout, index["manifests"][0]["digest"]))
    config = json.loads(oci_blob(layout, manifest["config"]["digest"]))
    return index, manifest, config


def extract_file(archive, path, out):
    with tarfile.open(archive) as layout:
        _, manifest, _ = oci_image(layout)
        found = None
        for descriptor in manifest["layers"]:
            with tarfile.open(fileobj=io.BytesIO(oci_blob(layout, descriptor["digest"])), mode="r:*") as layer:
                for member in layer.getmembers():
                    if member.isfile() and member.name.lstrip("./") == path.lstrip("/"):
                        found = layer.extractfile(member).read()
        if found is None:
            fail(f"{archive} has no file {path}")
    with open(out, "wb") as target:
        target.write(found)


def sha256_digest(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def add_layer(archive, out, name, path, file):
    with open(file, "rb") as source:
        data = source.read()
    layer_bytes = io.BytesIO()
    with tarfile.open(fileobj=layer_bytes, mode="w", format=tarfile.PAX_FORMAT) as layer:
        info = tarfile.TarInfo(path.lstrip("/"))
        info.size = len(data)
        info.mode = 0o755
        layer.addfile(info, io.BytesIO(data))
    layer_data = layer_bytes.getvalue()
    with tarfile.open(archive) as layout:
        index, manifest, config = oci_image(layout)
        blobs = {}
        for member in layout.getmembers():
            if member.isfile() and member.name.startswith("blobs/"):
                blobs[member.name] = layout.extractfile(member).read()
    config["rootfs"]["diff_ids"].append(sha256_digest(layer_data))
    config.setdefault("history", []).append({"created_by": f"cri.py add-layer {path}"})
    config_data = json.dumps(config).encode()
    manifest["config"] = dict(manifest["config"], digest=sha256_digest(config_data), size=len(config_data))
    manifest["layers"].append(
        {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": sha256_digest(layer_data), "size": len(layer_data)}
    )
    manifest_data = json.dumps(manifest).encode()
    descriptor = dict(index["manifests"][0], digest=sha256_digest(manifest_data), size=len(manifest_data))
    descriptor["annotations"] = dict(descriptor.get("annotations", {}), **{"org.opencontainers.image.ref.name": name})
    index["manifests"] = [descriptor]
    for data in (layer_data, config_data, manifest_data):
        blobs["blobs/sha256/" + hashlib.sha256(data).hexdigest()] = data
    with tarfile.open(out, mode="w") as target:
        tar_member(target, "oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode())
        tar_member(target, "index.json", json.dumps(index).encode())
        for blob_name, data in sorted(blobs.items()):
            tar_member(target, blob_name, data)


def runtime_client(stubs, socket):
    sys.path.insert(0, stubs)
    try:
        import grpc  # noqa: PLC0415 (only the gRPC commands need it)
    except ImportError:
        fail("python3-grpcio is missing: apt-get install python3-grpcio (run with /usr/bin/python3)")
    try:
        import api_pb2  # noqa: PLC0415
        from google.protobuf import json_format  # noqa: PLC0415
    except ImportError as error:
        fail(f"cannot import the generated stubs from {stubs} ({error}): run `cri.py stubs {stubs}` first")
    channel = grpc.insecure_channel(f"unix://{socket}")
    return grpc, api_pb2, json_format, channel


def call(grpc, api_pb2, json_format, channel, method, request_json, timeout):
    request_type = getattr(api_pb2, f"{method}Request", None)
    response_type = getattr(api_pb2, f"{method}Response", None)
    if request_type is None or response_type is None:
        fail(f"unknown RuntimeService method {method}")
    request = json_format.Parse(request_json, request_type())
    stub = channel.unary_unary(
        f"/runtime.v1.RuntimeService/{method}",
        request_serializer=request_type.SerializeToString,
        response_deserializer=response_type.FromString,
    )
    try:
        response = stub(request, timeout=timeout)
    except grpc.RpcError as error:
        fail(f"{method} failed: {error.code().name}: {error.details()}")
    return json_format.MessageToJson(
        response, preserving_proto_field_name=True, including_default_value_fields=True, indent=None
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stubs")
    parser.add_argument("--socket")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("command", choices=["stubs", "image", "extract", "add-layer", "wait", "call"])
    parser.add_argument("arguments", nargs="*")
    options = parser.parse_args()
    if options.command == "stubs":
        if len(options.arguments) != 1:
            fail("usage: cri.py stubs DIR")
        generate_stubs(options.arguments[0])
        return
    if options.command == "image":
        if len(options.arguments) < 3:
            fail("usage: cri.py image TAR NAME COMMAND...")
        write_image(options.arguments[0], options.arguments[1], options.arguments[2:])
        return
    if options.command == "extract":
        if len(options.arguments) != 3:
            fail("usage: cri.py extract ARCHIVE PATH OUT")
        extract_file(*options.arguments)
        return
    if options.command == "add-layer":
        if len(options.arguments) != 5:
            fail("usage: cri.py add-layer ARCHIVE OUT NAME PATH FILE")
        add_layer(*options.arguments)
        return
    if not options.stubs or not options.socket:
        fail(f"{options.command} needs --stubs and --socket")
    grpc, api_pb2, json_format, channel = runtime_client(options.stubs, options.socket)
    if options.command == "wait":
        try:
            grpc.channel_ready_future(channel).result(timeout=30)
        except grpc.FutureTimeoutError:
            fail(f"nothing answers on {options.socket} after 30 s")
        print(call(grpc, api_pb2, json_format, channel, "Version", "{}", options.timeout))
        return
    if len(options.arguments) != 2:
        fail("usage: cri.py call METHOD REQUEST_JSON")
    method, request_json = options.arguments
    print(call(grpc, api_pb2, json_format, channel, method, request_json, options.timeout))


if __name__ == "__main__":
    main()
