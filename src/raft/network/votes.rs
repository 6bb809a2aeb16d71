//! Vote refusal and transfer state: when this node refuses a pre-vote or a
//! vote (the start-up window, a live leader, a non-voter, a transfer to
//! another node), and the transfer's campaign (see the parent's docs).

use super::*;

impl Peers {
    /// Why this node would not vote for `candidate` (whose log ends before
    /// `next_index`) in a new election now, if it would not.
    pub(super) fn refuse_pre_vote(
        &self,
        candidate: NodeId,
        next_index: u64,
        raft: &Raft,
    ) -> Option<String> {
        if let Some(why) = self.refuse_vote(candidate) {
            return Some(why);
        }
        if let Some(why) = self.refuse_non_voter(candidate, None) {
            return Some(why);
        }
        let metrics = raft.metrics().borrow().clone();
        let now = Instant::now();
        let own = *lock(&self.campaigned_at);
        let view = PreVoteView {
            leads: metrics.state == openraft::ServerState::Leader,
            campaigned_recently: own
                .is_some_and(|at| now.duration_since(at) < self.election_timeout_max / 4),
            asking: lock(&self.pre_voting_since).is_some(),
            quiet: now.duration_since(self.last_leader_contact()),
            log_end: metrics.last_log_index.map_or(0, |i| i + 1),
        };
        pre_vote_refusal(
            self.self_id,
            candidate,
            next_index,
            &view,
            self.election_timeout_max,
        )
    }

    /// Records that this node's own pre-vote round begins (`true`) or is
    /// over (`false`).
    pub fn note_pre_voting(&self, asking: bool) {
        *lock(&self.pre_voting_since) = asking.then(Instant::now);
    }

    /// Whether this node granted another node's pre-vote at or after
    /// `since`: that node is about to campaign, and this one holds off
    /// rather than split the vote.
    pub fn granted_pre_vote_since(&self, since: Instant) -> bool {
        lock(&self.granted_pre_vote_at).is_some_and(|at| at >= since)
    }

    pub(super) fn note_pre_vote_granted(&self) {
        *lock(&self.granted_pre_vote_at) = Some(Instant::now());
    }

    /// Records that this node is starting a campaign now.
    pub fn note_campaign(&self) {
        *lock(&self.campaigned_at) = Some(Instant::now());
    }

    /// When a peer last refused our vote because its log is ahead.
    pub fn last_behind(&self) -> Option<Instant> {
        *lock(&self.behind_since)
    }

    /// Whether a transfer to another node is running: this node then
    /// neither campaigns nor votes for anyone but the target.
    pub fn transfer_elsewhere(&self) -> bool {
        matches!(*lock(&self.transfer), Some((target, until)) if target != self.self_id && Instant::now() < until)
    }

    /// Marks a transfer to `target` as running for a few election timeouts.
    pub fn begin_transfer(&self, target: NodeId) {
        let until = Instant::now() + self.election_timeout_max * 4;
        *lock(&self.transfer) = Some((target, until));
    }

    /// Marks that this node, as leader, hands its leadership over (for a
    /// few election timeouts at most): it sends no heartbeats meanwhile
    /// (see [`crate::raft::heartbeat`]).
    pub fn begin_handover(&self) {
        *lock(&self.handing_over) = Some(Instant::now() + self.election_timeout_max * 4);
    }

    /// Ends this node's handover.
    pub fn end_handover(&self) {
        *lock(&self.handing_over) = None;
    }

    /// Whether this node hands its leadership over now. Only the handing
    /// node: the target, and every other peer told of the transfer, send
    /// heartbeats as soon as they lead.
    pub fn handing_over(&self) -> bool {
        lock(&self.handing_over).is_some_and(|until| Instant::now() < until)
    }

    /// Ends a transfer early.
    pub fn end_transfer(&self) {
        *lock(&self.transfer) = None;
    }

    /// Why node `candidate` (as `member`, when the request names it) may
    /// not be elected as far as this node's membership goes: it is not a
    /// voter, or not in the incarnation the membership names (S8). Refusing
    /// a vote is always safe; this keeps a removed node, or a node's former
    /// incarnation, from disturbing the members. A node with no membership
    /// (forming) refuses nobody on this ground.
    pub(super) fn refuse_non_voter(
        &self,
        candidate: NodeId,
        member: Option<MemberId>,
    ) -> Option<String> {
        let book = self.members.entries();
        if book.is_empty() {
            return None;
        }
        match book.get(&candidate) {
            None => Some(format!("node {candidate} is not a member")),
            Some(entry) if !entry.voter => Some(format!("node {candidate} is not a voter")),
            Some(entry) if member.is_some_and(|m| m != entry.member) => Some(format!(
                "member {} is not the incarnation of node {candidate} in the membership ({})",
                member.unwrap_or_default(),
                entry.member
            )),
            Some(_) => None,
        }
    }

    /// Why a vote from `candidate` must be refused now, if it must.
    pub(super) fn refuse_vote(&self, candidate: NodeId) -> Option<String> {
        let now = Instant::now();
        let transfer = *lock(&self.transfer);
        // The target of a running transfer gets the vote even in the
        // start-up window: the leader that this node heard (or is) hands
        // over, so no forgotten lease of another leader can be running.
        let transfer_target =
            matches!(transfer, Some((target, until)) if target == candidate && now < until);
        if now < self.votes_from && !transfer_target {
            return Some("starting up: not voting yet".into());
        }
        match transfer {
            Some((target, until)) if now < until && candidate != target => {
                Some(format!("leadership is being transferred to node {target}"))
            }
            _ => None,
        }
    }
}

/// What a node knows of itself when a peer asks for its pre-vote.
#[derive(Debug, Clone, Copy)]
struct PreVoteView {
    /// It leads.
    leads: bool,
    /// It started a campaign of its own within `election_max / 4`.
    campaigned_recently: bool,
    /// Its own pre-vote round is running.
    asking: bool,
    /// How long since it heard a leader (or granted a vote).
    quiet: Duration,
    /// Where its log ends (the next index).
    log_end: u64,
}

/// Why `me` would not grant `candidate`'s pre-vote (its log ending before
/// `next_index`), if it would not. Of two nodes that lost the leader at
/// once, the one that campaigned first wins; of two asking at the same
/// moment, the longer log, or on a tie the lower id (the other grants it
/// and holds off; see `detector`).
fn pre_vote_refusal(
    me: NodeId,
    candidate: NodeId,
    next_index: u64,
    view: &PreVoteView,
    election_max: Duration,
) -> Option<String> {
    if view.leads {
        return Some("this node leads".into());
    }
    if view.campaigned_recently {
        return Some("campaigning myself".into());
    }
    if view.asking && next_index <= view.log_end && candidate > me {
        return Some("asking for votes myself; the lower id goes first".into());
    }
    if view.quiet < election_max {
        return Some(format!("heard a leader {:?} ago", view.quiet));
    }
    if next_index < view.log_end {
        return Some(format!(
            "log ends at {next_index}, mine at {}",
            view.log_end
        ));
    }
    None
}

/// The target of a transfer campaigns at once: the old leader closed and
/// drained its gate and stopped its heartbeats before it asked, so there is
/// no lease of its to wait out, and it votes for the target as soon as its
/// own openraft vote lease allows (at once when it has led longer than
/// `election_timeout_max`). Another follower's openraft lease runs until
/// `election_timeout_max` after the last heartbeat, so where the old
/// leader's vote is not enough (five nodes, a leader elected moments ago),
/// the target tries again every two heartbeats until then, and once more
/// after it.
pub(super) async fn campaign_for_transfer(raft: Raft, peers: Arc<Peers>) {
    let started = Instant::now();
    let until = started + peers.election_timeout_max + Duration::from_millis(20);
    let retry = Duration::from_millis(100);
    loop {
        if let Err(err) = raft.trigger().elect().await {
            tracing::warn!(%err, "could not start the transfer election");
            return;
        }
        let won = raft
            .wait(Some(retry))
            .state(openraft::ServerState::Leader, "transfer election")
            .await
            .is_ok();
        if won {
            tracing::info!(took = ?started.elapsed(), "took leadership over");
            return;
        }
        let now = Instant::now();
        if now >= until {
            tracing::warn!("the transfer election did not win; the failure detector takes over");
            return;
        }
        // Campaign again, at the latest just after every follower's
        // openraft lease on the old leader has run out.
        tokio::time::sleep_until((now + retry).min(until)).await;
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn of_two_nodes_asking_at_once_the_longer_log_then_the_lower_id_goes_first() {
        let max = Duration::from_millis(450);
        let idle = PreVoteView {
            leads: false,
            campaigned_recently: false,
            asking: false,
            quiet: Duration::from_millis(500),
            log_end: 10,
        };
        let asking = PreVoteView {
            asking: true,
            ..idle
        };
        let (one, two, three) = (NodeId(1), NodeId(2), NodeId(3));
        // Not asking itself: anyone with a log as long is granted.
        assert_eq!(pre_vote_refusal(one, two, 10, &idle, max), None);
        // Asking: a higher id with no longer a log is refused...
        assert!(pre_vote_refusal(one, two, 10, &asking, max).is_some());
        assert!(pre_vote_refusal(two, three, 9, &asking, max).is_some());
        // ...a lower id is granted, and so is a longer log.
        assert_eq!(pre_vote_refusal(two, one, 10, &asking, max), None);
        assert_eq!(pre_vote_refusal(one, three, 11, &asking, max), None);
        // The other rules still hold.
        let heard = PreVoteView {
            quiet: Duration::from_millis(100),
            ..idle
        };
        assert!(pre_vote_refusal(two, one, 10, &heard, max).is_some());
        assert!(pre_vote_refusal(two, one, 9, &idle, max).is_some());
        let campaigning = PreVoteView {
            campaigned_recently: true,
            ..idle
        };
        assert!(pre_vote_refusal(two, one, 10, &campaigning, max).is_some());
    }
}
