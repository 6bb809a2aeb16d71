//! The failure detector that starts elections.
//!
//! openraft's own election timer is left off. Its candidates time out at a
//! random point in `[election_min, election_max)` after the last heartbeat,
//! while every follower refuses votes until `election_max` after it — so the
//! first attempt is nearly always refused, and failover takes two rounds.
//!
//! Instead a follower campaigns once it has heard no leader (and granted no
//! vote) for `election_max` plus a random jitter of up to `election_min / 6`:
//! by then the other followers' vote leases have run out, and the jitter
//! makes two candidates in the same round unlikely. It sleeps until the
//! moment a campaign could be due (at most `election_min / 2`, at least
//! [`POLL`]) and decides anew at every look from the last leader contact,
//! so it notices at most [`POLL`] late, while an idle group wakes only a
//! few times a second (a node runs a detector per group). A candidate that does not
//! win tries again after a third of `election_min` plus a fresh jitter
//! (there is no leader lease left to wait out) — but never sooner than
//! `election_max` after it last heard a leader or granted a vote: a node
//! that grants a vote resets its clock, so it does not disturb the candidate
//! it voted for, and a node that heard a leader since its last attempt waits
//! out that leader's lease in full.
//!
//! **Pre-vote.** Before campaigning, a node asks its peers whether they
//! would vote for it: only if they too have heard no leader for
//! `election_max`, are not in their start-up window, and do not hold a
//! longer log. Without a majority of yes it does not raise its term, so a
//! node that was merely cut off does not force an election when it heals.
//! A node that started its own campaign within the last `election_max / 4`
//! refuses pre-votes: of two nodes that lost the leader at once, the first
//! to campaign wins and the other votes for it instead of unseating it.
//! Two that ask at the same moment would split the vote and lose a round
//! (measured: about 150 ms of the slowest failovers), so ties are broken
//! by id: while its own pre-vote runs, a node refuses a higher id's and
//! grants a lower id's; and a node that granted a pre-vote during its own
//! round, or in the last `election_max / 4`, holds off its campaign, since
//! the node it granted is about to run.
//!
//! A candidate whose vote a peer refused because the peer's log is ahead
//! holds off for `election_max`. openraft does not make the peer adopt the
//! candidate's higher term in that case, so without holding off the two can
//! leapfrog terms for seconds, each refusing the other.
//!
//! The lease bound in [`super`] rests on this: no node campaigns sooner than
//! `election_max` (≥ `election_min`) after the last leader contact it
//! recorded, and a contact is recorded on every request the leader counts
//! as an acknowledgement.

use std::sync::Arc;
use std::time::Duration;

use openraft::ServerState;
use tokio::time::Instant;

use super::network::Peers;
use super::{Raft, RaftTiming};
use crate::proto::raft::PreVoteRequest;

/// How often the detector looks for a silent leader.
pub const POLL: Duration = Duration::from_millis(5);

/// How long to sleep from `now` for a campaign due at `due`: until then,
/// but never longer than `election_min / 2` (a leader heard meanwhile
/// moves `due` on, and is seen at the next look) nor shorter than
/// [`POLL`]. Only the sleep depends on it: whether a campaign is due is
/// decided anew at every look, from the last leader contact.
fn until_due(now: Instant, due: Instant, timing: RaftTiming) -> Duration {
    due.saturating_duration_since(now)
        .clamp(POLL, (timing.election_min / 2).max(POLL))
}

/// A small xorshift generator: jitter needs no cryptographic quality.
struct Jitter(u64);

impl Jitter {
    fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    fn below(&mut self, bound: Duration) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        let millis = bound.as_millis().max(1) as u64;
        Duration::from_millis(self.0 % millis)
    }
}

/// Runs until Raft stops: campaigns when the leader has been quiet too long.
pub async fn run(raft: Raft, peers: Arc<Peers>, timing: RaftTiming) {
    let seed = peers.self_id().0.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
    let mut jitter = Jitter::new(seed);
    let spread = timing.election_min / 6;
    // Quiet needed since the last leader contact, and since our own last
    // attempt.
    let mut leader_quiet = timing.election_max + jitter.below(spread);
    let mut retry_after = Duration::ZERO;
    let mut last_attempt = Instant::now();
    let mut metrics = raft.metrics();
    // How long to sleep before looking again: only as long as nothing can
    // be due (see `until_due`), so an idle group costs a few wakeups a
    // second, not one every poll.
    let mut pause = POLL;
    loop {
        tokio::time::sleep(pause).await;
        pause = timing.election_min / 2;
        if metrics.has_changed().is_err() {
            return;
        }
        {
            let m = metrics.borrow_and_update();
            if m.state == ServerState::Leader {
                continue;
            }
            // S8: only a voter campaigns. A node waiting to be (re-)added
            // has no membership naming it, and a learner has no vote.
            let me = peers.self_member();
            if !m
                .membership_config
                .membership()
                .voter_ids()
                .any(|v| v == me)
            {
                continue;
            }
        }
        let now = Instant::now();
        if peers.transfer_elsewhere() {
            // Leadership is being handed to another node: let it.
            pause = POLL.max(timing.recheck());
            continue;
        }
        if peers
            .last_behind()
            .is_some_and(|at| now.duration_since(at) < timing.election_max)
        {
            // A peer's log is ahead of ours: let it win instead.
            pause = POLL.max(timing.recheck());
            continue;
        }
        let heard = peers.last_leader_contact();
        let due = (heard + leader_quiet).max(last_attempt + retry_after);
        if now < due {
            pause = until_due(now, due, timing);
            continue;
        }
        let recently = now.checked_sub(timing.election_max / 4).unwrap_or(now);
        if peers.granted_pre_vote_since(recently) {
            // Another node is about to campaign with our pre-vote: look
            // again soon, in case it does not.
            pause = POLL.max(timing.recheck());
            continue;
        }
        let next_index = metrics.borrow().last_log_index.map_or(0, |i| i + 1);
        let asked = Instant::now();
        peers.note_pre_voting(true);
        let granted = pre_vote(&peers, next_index, timing.election_min / 2).await;
        peers.note_pre_voting(false);
        if granted && peers.granted_pre_vote_since(asked) {
            tracing::info!(node = %peers.self_id(), "granted a lower id's pre-vote meanwhile; letting it run");
            last_attempt = Instant::now();
            retry_after = timing.campaign_retry() + jitter.below(spread);
            continue;
        }
        if !granted {
            // A majority still hears a leader (or is ahead of us): raising
            // the term now would only disturb it. Look again later.
            tracing::info!(node = %peers.self_id(), "pre-vote refused; not campaigning");
            last_attempt = Instant::now();
            retry_after = timing.campaign_retry() + jitter.below(spread);
            continue;
        }
        tracing::info!(node = %peers.self_id(), quiet = ?now.duration_since(heard), "no leader heard; campaigning");
        peers.note_campaign();
        if raft.trigger().elect().await.is_err() {
            return;
        }
        last_attempt = Instant::now();
        // After our own attempt there is no leader's lease left to wait
        // out; retry soon, with fresh jitter against another split vote.
        retry_after = timing.campaign_retry() + jitter.below(spread);
        leader_quiet = timing.election_max + jitter.below(spread);
    }
}

/// Asks every peer whether it would vote for this node; true when this
/// node and the peers that said yes make a majority of the cluster.
async fn pre_vote(peers: &Peers, next_index: u64, timeout: Duration) -> bool {
    let request = PreVoteRequest {
        cluster_id: peers.cluster_id().to_string(),
        from: peers.self_id().0,
        next_index,
        to: 0,
        group: peers.group().0,
    };
    let voters: Vec<_> = peers
        .book()
        .entries()
        .into_iter()
        .filter(|(id, entry)| entry.voter && *id != peers.self_id())
        .map(|(id, entry)| (id, entry.member))
        .collect();
    let asks = voters.iter().map(|(peer, member)| {
        let (peer, request) = (
            *peer,
            PreVoteRequest {
                to: member.0,
                ..request.clone()
            },
        );
        async move {
            let Ok(mut client) = peers.client(peer) else {
                return false;
            };
            let mut grpc = tonic::Request::new(request);
            grpc.set_timeout(timeout);
            matches!(client.pre_vote(grpc).await, Ok(reply) if reply.get_ref().granted)
        }
    });
    let granted = futures::future::join_all(asks)
        .await
        .into_iter()
        .filter(|g| *g)
        .count();
    let cluster = voters.len() + 1;
    (granted + 1) * 2 > cluster
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jitter_stays_below_its_bound_and_varies() {
        let mut jitter = Jitter::new(42);
        let draws: Vec<Duration> = (0..100)
            .map(|_| jitter.below(Duration::from_millis(100)))
            .collect();
        assert!(draws.iter().all(|d| *d < Duration::from_millis(100)));
        assert!(draws.iter().any(|d| *d != draws[0]));
        assert_eq!(Jitter::new(0).below(Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn the_detector_sleeps_until_a_campaign_could_be_due_and_no_longer() {
        let timing = RaftTiming::default();
        let now = Instant::now();
        let ms = Duration::from_millis;
        assert_eq!(until_due(now, now + ms(40), timing), ms(40));
        // A leader heard meanwhile moves the due time on: look again
        // within half the shortest election timeout.
        assert_eq!(
            until_due(now, now + ms(400), timing),
            timing.election_min / 2
        );
        // Due now, or already past: the shortest look.
        assert_eq!(until_due(now, now, timing), POLL);
        assert_eq!(until_due(now + ms(10), now, timing), POLL);
    }
}
