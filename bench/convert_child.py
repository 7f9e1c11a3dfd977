"""Child of convert_bench.py: one rank through our host+device -> validated .et path, or a bare orjson parse."""
import json
import sys
import time
from trace_tools.command_line import ArgumentParser


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=["convert", "parse"],
                        help="convert: trace_tools.pipeline.convert_rank (what convert_to_et.py runs per rank); "
                             "parse: read both files and orjson.loads them once (the floor any converter pays)")
    parser.add_argument("host")
    parser.add_argument("device")
    parser.add_argument("--out", help="the .et to write (convert)")
    parser.add_argument("--merged", default=None, help="also write the merged JSON chakra_converter reads (convert)")
    parser.add_argument("--rank", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    if args.mode == "parse":
        from trace_tools.load import read_trace_bytes
        import orjson
        documents = [orjson.loads(read_trace_bytes(path)) for path in (args.host, args.device)]
        print(json.dumps({"seconds": time.perf_counter() - started, "documents": len(documents)}))
        return 0
    from trace_tools.load import TraceError
    from trace_tools.pipeline import convert_rank
    try:
        result = convert_rank(args.host, args.device, args.out, rank=args.rank, merged_path=args.merged)
    except TraceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"seconds": result.conversion_s, "timings": result.timings, "nodes": result.nodes,
                      "critical_path_us": result.critical_path_us, "traced_step_us": result.traced_step_us}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
