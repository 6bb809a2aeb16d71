//! `replica-ha status --watch`: the live view of a node, redrawn from one
//! status reply a second: the configured volume and its replicas, then
//! every volume with its writer, term and copies.
//!
//! The write rate is not in a reply: [`Watch`] derives it from the node's
//! write counters in two successive replies, and forgets the earlier one
//! when a reply is missing (the node restarting, say), so a rate never
//! spans a gap it did not see.

use std::time::Instant;

use super::lines::{io_line, or_none, reads_line, resync_progress, scrub_line, utc, volumes_block};
use crate::proto::admin::StatusReply;

/// The state of a live view between two frames: the previous sample of
/// the node's write counters.
#[derive(Debug, Default)]
pub struct Watch {
    /// When, writes and bytes written.
    last: Option<(Instant, u64, u64)>,
}

impl Watch {
    /// A view that has seen no reply yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The frame of `reply`, fetched at `at` (the clock the rate is measured
    /// by) and shown as of `at_unix` (Unix seconds, the header's time).
    pub fn frame(&mut self, reply: &StatusReply, at: Instant, at_unix: u64) -> String {
        let rate = self.last.map(|(then, writes, bytes)| {
            let seconds = at.duration_since(then).as_secs_f64().max(1e-3);
            (
                reply.writes_total.saturating_sub(writes) as f64 / seconds,
                reply.write_bytes_total.saturating_sub(bytes) as f64 / seconds,
            )
        });
        self.last = Some((at, reply.writes_total, reply.write_bytes_total));
        view(reply, rate, at_unix)
    }

    /// The frame while the node at `addr` cannot be reached, for `why`.
    pub fn unreachable(&mut self, addr: &str, why: &str) -> String {
        self.last = None;
        format!("cannot reach {addr}: {why} (trying again every second)\n")
    }
}

/// The live view of one status reply; `rate` is writes and bytes per
/// second since the last sample.
fn view(reply: &StatusReply, rate: Option<(f64, f64)>, at_unix: u64) -> String {
    let writes = match rate {
        Some((ops, bytes)) => format!("{ops:.0} writes/s, {:.1} MiB/s", bytes / 1048576.0),
        None => "writes/s: measuring".to_string(),
    };
    let mut view = format!(
        "replica-ha node {} ({}), {}\n\
         role {}  term {}  leader {}  gate {}  lease {} ms\n\
         in sync [{}]  reads {}\n\
         I/O {}  {writes}\n\
         scrub {}\n\n\
         {:<8} {:<11} {:>11} {:>6}  progress\n",
        reply.node_id,
        reply.cluster_id,
        utc(at_unix),
        reply.role,
        reply.term,
        or_none(reply.leader),
        if reply.gate_open { "open" } else { "closed" },
        reply.lease_remaining_ms,
        reply.in_sync.join(", "),
        reads_line(reply),
        io_line(reply),
        scrub_line(reply),
        "replica",
        "state",
        "fence floor",
        "dirty",
    );
    for r in &reply.replicas {
        let progress = if r.resync_running {
            resync_progress(r)
        } else if !r.reachable {
            format!("unreachable: {}", r.error)
        } else {
            String::new()
        };
        let (floor, dirty) = if r.reachable {
            (r.fence_floor.to_string(), r.dirty_extents.to_string())
        } else {
            ("?".into(), "?".into())
        };
        let id = if r.local {
            format!("{}*", r.id)
        } else {
            r.id.clone()
        };
        view.push_str(&format!(
            "{id:<8} {:<11} {floor:>11} {dirty:>6}  {progress}\n",
            r.state
        ));
    }
    let volumes = volumes_block(reply);
    if !volumes.is_empty() {
        view.push('\n');
        view.push_str(&volumes);
    }
    view.push_str("\n(* this node; Ctrl-C to stop)\n");
    view
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::Watch;
    use crate::api::status::samples::{busy_writer, waiting_node};

    /// 2026-11-30 00:53:20 UTC.
    const AT: u64 = 1_796_000_000;

    #[test]
    fn the_first_frame_measures_and_the_next_shows_the_write_rate_and_the_volumes() {
        let mut watch = Watch::new();
        let start = Instant::now();
        let mut reply = busy_writer();
        let first = watch.frame(&reply, start, AT);
        assert!(first.contains("  writes/s: measuring\n"));
        reply.writes_total += 24;
        reply.write_bytes_total += 6 << 20;
        let second = watch.frame(&reply, start + Duration::from_secs(2), AT + 2);
        assert_eq!(
            second,
            "replica-ha node 1 (c1), 2026-11-30 00:53:22 UTC\n\
             role leader  term 7  leader 1  gate open  lease 812 ms\n\
             in sync [1, 2]  reads served\n\
             I/O suspended: 3 requests waiting 1.2 s (1 in-sync replica of the 2 needed; \
             waiting for node 2's rebuild, 41%)  12 writes/s, 3.0 MiB/s\n\
             scrub 38% of a pass (last pass 2026-11-30 00:53:20 UTC: 64 extents, 1 differed, \
             1 repaired; 4 MiB/s)\n\
             \n\
             replica  state       fence floor  dirty  progress\n\
             1*       in_sync               7      4  \n\
             2        rebuilding            7      0  resync 42% (full: 100 of 240 MiB \
             compared, 4 MiB copied, 128 MiB/s, 2 s left)\n\
             3        offline               ?      ?  unreachable: no answer within 300ms\n\
             \n\
             volume           group writer   term  this node  copies\n\
             vol0                 0      1      7  writes     1 in_sync, 2 rebuilding, 3 offline\n\
             \x20 copy 2 of vol0: resync 42% (full: 100 of 240 MiB compared, 4 MiB copied, \
             128 MiB/s, 2 s left)\n\
             db                   1      2      3  copy       1 in_sync, 2 in_sync, 4 missing\n\
             logs                 2      -      -  no copy    on 2, 3, 4\n\
             new                  3      -      -  starting   on 1, 3, 4\n\
             \n\
             (* this node; Ctrl-C to stop)\n"
        );
    }

    #[test]
    fn a_missed_reply_starts_the_rate_over() {
        let mut watch = Watch::new();
        let start = Instant::now();
        watch.frame(&busy_writer(), start, AT);
        assert_eq!(
            watch.unreachable("127.0.0.1:7001", "connection refused"),
            "cannot reach 127.0.0.1:7001: connection refused (trying again every second)\n"
        );
        let frame = watch.frame(&busy_writer(), start + Duration::from_secs(1), AT + 1);
        assert!(frame.contains("  writes/s: measuring\n"));
    }

    #[test]
    fn a_follower_frame_shows_no_leader_a_closed_gate_and_no_replicas() {
        let frame = Watch::new().frame(&waiting_node(), Instant::now(), AT);
        assert_eq!(
            frame,
            "replica-ha node 3 (c1), 2026-11-30 00:53:20 UTC\n\
             role follower  term 0  leader -  gate closed  lease 0 ms\n\
             in sync []  reads refused (replica not in sync)\n\
             I/O flowing  writes/s: measuring\n\
             scrub -\n\
             \n\
             replica  state       fence floor  dirty  progress\n\
             \n\
             (* this node; Ctrl-C to stop)\n"
        );
    }
}
