//! `replica-ha status`: a status reply as the operator's table, one fact a
//! row, then one row a replica of the configured volume, then one row a
//! volume (the configured one and the table's).
//!
//! Tests and scripts read some rows by their names (`role`, `nbd export`,
//! `membership`, ...), so a row's name and the form of its value stay as
//! they are; a new fact gets a new row.

use std::fmt;

use super::lines::{
    io_line, member_line, or_none, reads_line, resync_progress, scrub_line, volumes_block,
};
use crate::proto::admin::StatusReply;

/// The table of one status reply; print it as it is (it ends in a newline).
pub struct Table<'a>(pub &'a StatusReply);

impl fmt::Display for Table<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let reply = self.0;
        let rows = [
            ("node", reply.node_id.to_string()),
            ("incarnation", format!("{:010x}", reply.incarnation)),
            ("membership", member_line(reply)),
            (
                "cluster",
                match reply.cluster_uuid.as_str() {
                    "" => reply.cluster_id.clone(),
                    uuid => format!("{} ({uuid})", reply.cluster_id),
                },
            ),
            ("security", reply.security.clone()),
            ("data address", reply.data_address.clone()),
            ("role", reply.role.clone()),
            ("gate open", reply.gate_open.to_string()),
            ("raft state", reply.raft_state.clone()),
            ("term", reply.term.to_string()),
            ("leader", or_none(reply.leader)),
            (
                "holds lease",
                format!("{} ({} ms left)", reply.is_self, reply.lease_remaining_ms),
            ),
            ("live members", format!("{:?}", reply.members)),
            (
                "prev writer",
                format!(
                    "{} (term {})",
                    or_none(reply.prev_writer),
                    reply.prev_writer_term
                ),
            ),
            ("in sync", reply.in_sync.join(", ")),
            ("reads", reads_line(reply)),
            ("I/O", io_line(reply)),
            ("fence floor", reply.fence_floor.to_string()),
            ("scrub", scrub_line(reply)),
            ("volume size", reply.volume_size.to_string()),
            ("min in sync", reply.min_in_sync.to_string()),
        ];
        for (name, value) in rows {
            writeln!(f, "{name:<14} {value}")?;
        }
        if !reply.nbd_address.is_empty() {
            let mode = if reply.gate_open {
                "read-write"
            } else if reply.reads_served {
                "read-only"
            } else {
                "not available: reads refused"
            };
            writeln!(
                f,
                "{:<14} nbd://{}/{} ({mode})",
                "nbd export", reply.nbd_address, reply.volume
            )?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "{:<8} {:<11} {:>11} {:>6}  note",
            "replica", "state", "fence floor", "dirty"
        )?;
        for r in &reply.replicas {
            let local = if r.local { "this node" } else { "" };
            let (floor, dirty, note) = if r.reachable {
                (
                    r.fence_floor.to_string(),
                    r.dirty_extents.to_string(),
                    local.to_string(),
                )
            } else {
                ("?".into(), "?".into(), format!("unreachable: {}", r.error))
            };
            let note = if r.resync_running {
                format!("{note} {}", resync_progress(r))
            } else if r.resync_total_bytes > 0 {
                format!(
                    "{note} last resync copied {} MiB",
                    r.resync_copied_bytes >> 20
                )
            } else {
                note
            };
            writeln!(
                f,
                "{:<8} {:<11} {floor:>11} {dirty:>6}  {note}",
                r.id, r.state
            )?;
        }
        let volumes = volumes_block(reply);
        if !volumes.is_empty() {
            write!(f, "\n{volumes}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::Table;
    use crate::api::status::samples::{busy_writer, configured_writer, waiting_node};

    #[test]
    fn the_table_of_a_busy_writer_shows_every_fact_replica_and_volume() {
        assert_eq!(
            Table(&busy_writer()).to_string(),
            r#"node           1
incarnation    0000abc123
membership     member
cluster        c1 (5f0c9a1e-0000-4000-8000-000000000001)
security       mutual TLS
data address   127.0.0.1:7101
role           leader
gate open      true
raft state     leader
term           7
leader         1
holds lease    true (812 ms left)
live members   [1, 2, 3]
prev writer    1 (term 7)
in sync        1, 2
reads          served
I/O            suspended: 3 requests waiting 1.2 s (1 in-sync replica of the 2 needed; waiting for node 2's rebuild, 41%)
fence floor    7
scrub          38% of a pass (last pass 2026-11-30 00:53:20 UTC: 64 extents, 1 differed, 1 repaired; 4 MiB/s)
volume size    16777216
min in sync    2
nbd export     nbd://127.0.0.1:10809/vol0 (read-write)

replica  state       fence floor  dirty  note
1        in_sync               7      4  this node
2        rebuilding            7      0   resync 42% (full: 100 of 240 MiB compared, 4 MiB copied, 128 MiB/s, 2 s left)
3        offline               ?      ?  unreachable: no answer within 300ms last resync copied 3 MiB

volume           group writer   term  this node  copies
vol0                 0      1      7  writes     1 in_sync, 2 rebuilding, 3 offline
  copy 2 of vol0: resync 42% (full: 100 of 240 MiB compared, 4 MiB copied, 128 MiB/s, 2 s left)
db                   1      2      3  copy       1 in_sync, 2 in_sync, 4 missing
logs                 2      -      -  no copy    on 2, 3, 4
new                  3      -      -  starting   on 1, 3, 4
"#
        );
    }

    #[test]
    fn a_reply_without_volumes_shows_the_configured_volume_as_before_and_no_volume_rows() {
        let old = Table(&configured_writer()).to_string();
        let new = Table(&busy_writer()).to_string();
        assert!(new.starts_with(&old), "{old}\n---\n{new}");
        assert!(old.ends_with("last resync copied 3 MiB\n"), "{old}");
        assert!(!old.contains("this node  copies"), "{old}");
    }

    #[test]
    fn the_table_of_a_waiting_node_says_why_it_is_not_a_member() {
        assert_eq!(
            Table(&waiting_node()).to_string(),
            "node           3\n\
             incarnation    000000001f\n\
             membership     replaced disk: waiting to be re-added \
             (`replica-ha members replace --id 3`)\n\
             cluster        c1\n\
             security       insecure\n\
             data address   127.0.0.1:7103\n\
             role           follower\n\
             gate open      false\n\
             raft state     learner\n\
             term           0\n\
             leader         -\n\
             holds lease    false (0 ms left)\n\
             live members   []\n\
             prev writer    - (term 0)\n\
             in sync        \n\
             reads          refused (replica not in sync)\n\
             I/O            flowing\n\
             fence floor    0\n\
             scrub          -\n\
             volume size    0\n\
             min in sync    0\n\
             \n\
             replica  state       fence floor  dirty  note\n"
        );
    }
}
