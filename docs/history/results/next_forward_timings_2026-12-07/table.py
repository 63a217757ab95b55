"""The table in README.md from out.jsonl and out_more.jsonl: per run, the plan's prediction, the one-slot plan's, the slots kept, the
median of steps 4-8, and the median of the steps 4-8 that ran the backward schedule (two slots: the chooser's
next_forward probes taken out)."""
import json, pathlib, statistics

here = pathlib.Path(__file__).parent
rows = [json.loads(line) for name in ("out.jsonl", "out_more.jsonl") for line in (here / name).read_text().splitlines() if line]
print("| round | tree | budget | state_slots | kept | warm-up's next_forward window: fwd, bwd (s), AdamW (M/s) | "
      "one-slot plan | plan | measured, steps 4-8 | of them under backward | state RAM / SSD (GiB) | loss |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    w = r.get("next_forward_window")
    window = f"{w['fwd_s']}, {w['bwd_s']}, {w['adam_M_per_s']}" if w else "—"
    b = [t for t, s in zip(r["steps_s"][4:], r["schedules"][4:]) if s == "b"]
    print(f"| {r['round']} | {'before' if r['tree'] == 'main' else 'after'} | {r['budget']} | {r['state_slots']} | "
          f"{r['kept']} | {window} | {r.get('one_slot_predicted_s') or '—'} | {r['predicted_s']} | "
          f"{r['median_step_4_8_s']} | {round(statistics.median(b), 3) if b else '—'} | {r['state_ram_GiB']} / "
          f"{r['state_ssd_GiB']} | {r['loss']} |")
