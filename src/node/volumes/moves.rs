//! Moving a volume's copy (`replica-ha volume move NAME --from A --to B`),
//! as the cluster group's leader decides it.
//!
//! The leader checks the move against the table as applied (the volume
//! exists, `A` holds a copy and `B` none, `B` is a voter of the cluster),
//! asks every member what its build knows and `B` how much room it has
//! (`Node.Hello`), and commits `MoveVolume` in its term: the placement
//! names `B` instead of `A`, and so does the preferred writer if it was
//! `A`. Nothing is moved while a member that answers runs a build without
//! [`FEATURE_MOVES`] (it could not apply the entry, nor follow the
//! placement).
//!
//! The copy itself moves afterwards, in the volume's own group, driven by
//! its writer (`node::placement`): `B` joins as a learner, its copy is
//! rebuilt into the in-sync set and it becomes a voter; only then does
//! `A` leave (its writer hands over first, when it was `A`), and `A`'s
//! node removes its copy once it is out of the group. So the volume never
//! has fewer in-sync copies than before the move, and every step is the
//! membership change `members add`/`remove` makes, with its checks.

use super::VolumeTableChanges;
use crate::api::admin::VolumeError;
use crate::ids::{NodeId, VolumeId};
use crate::node::hello::FEATURE_MOVES;
use crate::raft::Request;
use crate::raft::volume_table::{TableError, VolumeEntry};

impl VolumeTableChanges {
    /// Moves volume `name`'s copy from `from` to `to` (see the module
    /// docs); returns the entry as the table then holds it.
    pub(super) async fn move_copy_now(
        &self,
        name: VolumeId,
        from: NodeId,
        to: NodeId,
    ) -> Result<VolumeEntry, VolumeError> {
        let term = self.leading().await?;
        let table = self.cluster.state_machine().current().control.volumes;
        let entry = table
            .get(&name)
            .ok_or_else(|| TableError::Unknown(name.clone()))?;
        if entry.placement.contains(&to) && !entry.placement.contains(&from) {
            return Ok(entry.clone());
        }
        let members = self.members();
        if !members.keys().any(|member| member.node() == to) {
            return Err(VolumeError::Refused(format!(
                "node {to} is not a voting member of the cluster"
            )));
        }
        let mut room = None;
        for (member, answer) in self.answers(&members).await {
            match answer {
                Ok((features, _)) if features & FEATURE_MOVES == 0 => {
                    return Err(VolumeError::Refused(format!(
                        "node {} runs an earlier build that cannot move copies; upgrade it",
                        member.node()
                    )));
                }
                Ok((_, free)) if member.node() == to => room = free,
                Err(why) if member.node() == to => {
                    return Err(VolumeError::Refused(format!(
                        "node {to} did not answer ({why}); a copy moves only to a node that \
                         says it has room"
                    )));
                }
                _ => {}
            }
        }
        // Refused here, with the table's own reason, rather than in the log.
        table.clone().move_copy(&name, from, to, room)?;
        let request = Request::MoveVolume {
            name: name.clone(),
            from,
            to,
            free: room,
        };
        let response = self.commit(term, request).await?;
        response
            .volume
            .ok_or_else(|| VolumeError::Failed("the move answered without the volume".into()))
    }
}
