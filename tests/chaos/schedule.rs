//! Fault schedules: what to break, for how long, drawn from a seed so a run
//! replays. A schedule is a list of steps; each injects one fault, holds it,
//! heals it and lets the cluster settle before the next. One fault at a time
//! keeps a majority alive, so the cluster must stay (or soon become)
//! writable throughout; safety is checked whatever happens.

use std::fmt;
use std::time::Duration;

use super::rng::Rng;

/// Which node a fault hits, resolved when it is injected.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Target {
    /// The current writer (or, when there is none, the Raft leader).
    Leader,
    /// A node that is not the writer.
    Follower,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fault {
    /// SIGKILL, restarted after the hold.
    Kill(Target),
    /// SIGSTOP for longer than the lease, then SIGCONT.
    Pause(Target),
    /// Every link to and from the node stalls (nothing is reset).
    Isolate(Target),
    /// Only the link between the writer and one follower stalls.
    CutLink,
    /// SIGTERM and a restart.
    Restart(Target),
    /// A graceful leadership transfer to a follower.
    Transfer,
    /// The node's replica file system is full: writes that allocate fail
    /// with ENOSPC (and so do metadata writes) until it is healed.
    DiskFull(Target),
    /// nbdcopy, at its default parallelism, copies an image into the
    /// writer again and again for the hold, hundreds of MiB in one term,
    /// and the writer is then killed mid-stream: the next promotion must
    /// converge what the term left marked, quickly and completely.
    Fill,
    /// Every fsync and fdatasync of the node (its Raft log and its data)
    /// stalls for 2 s at a time during the hold, through an LD_PRELOAD
    /// shim: its lease must run out on time, and no gate may overlap.
    SlowFsync(Target),
    /// The follower's data dir is deleted (a replaced disk) and it
    /// restarts as a new incarnation; the harness waits until it says it
    /// waits to be re-added, and replaces it (`members replace`). Its
    /// rebuild must not lose or mix up anything (S8).
    WipeFollower,
    /// The writer grows the volume by 1 MiB (`replica-ha resize`), best
    /// effort: a follower down meanwhile must be grown by its rebuild, and
    /// every copy must end with the same bytes up to the committed size.
    Resize,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let target = |t: &Target| match t {
            Target::Leader => "leader",
            Target::Follower => "follower",
        };
        match self {
            Fault::Kill(t) => write!(f, "kill-{}", target(t)),
            Fault::Pause(t) => write!(f, "pause-{}", target(t)),
            Fault::Isolate(t) => write!(f, "isolate-{}", target(t)),
            Fault::CutLink => write!(f, "cut-link"),
            Fault::Restart(t) => write!(f, "restart-{}", target(t)),
            Fault::Transfer => write!(f, "transfer"),
            Fault::DiskFull(t) => write!(f, "disk-full-{}", target(t)),
            Fault::Fill => write!(f, "fill"),
            Fault::SlowFsync(t) => write!(f, "slow-fsync-{}", target(t)),
            Fault::WipeFollower => write!(f, "wipe-follower"),
            Fault::Resize => write!(f, "resize"),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Step {
    pub fault: Fault,
    /// How long the fault stays before it is healed.
    pub hold: Duration,
    /// How long the cluster runs unharmed afterwards.
    pub settle: Duration,
}

/// `faults` steps drawn from `seed`; with `only` non-empty, only faults
/// whose name (as displayed) is in it.
pub fn generate(seed: u64, faults: usize, only: &[String]) -> Vec<Step> {
    let mut rng = Rng::new(seed);
    let mut steps = Vec::new();
    // Bounded: a name that matches nothing yields fewer steps, not a hang.
    for _ in 0..faults * 1000 {
        if steps.len() == faults {
            break;
        }
        let step = draw(&mut rng);
        if only.is_empty() || only.contains(&step.fault.to_string()) {
            steps.push(step);
        }
    }
    steps
}

fn draw(rng: &mut Rng) -> Step {
    {
        {
            let target = if rng.below(2) == 0 {
                Target::Leader
            } else {
                Target::Follower
            };
            let (fault, hold) = match rng.below(11) {
                0 => (Fault::Kill(target), rng.millis(300, 3000)),
                // Longer than the election timeout (at most 450 ms), so the
                // lease runs out while the process is stopped; up to longer
                // than the workload's 4 s write timeout, so a client gives
                // up, rewrites the block on the next writer, and then the
                // stopped writer resumes with the old write in hand.
                1 => (Fault::Pause(target), rng.millis(700, 6000)),
                2 => (Fault::Isolate(target), rng.millis(400, 3000)),
                3 => (Fault::CutLink, rng.millis(400, 2500)),
                4 => (Fault::Restart(target), rng.millis(100, 1500)),
                5 => (Fault::DiskFull(target), rng.millis(400, 3000)),
                6 => (Fault::Fill, rng.millis(1500, 5000)),
                7 => (Fault::SlowFsync(target), rng.millis(1000, 5000)),
                8 => (Fault::WipeFollower, rng.millis(100, 1500)),
                9 => (Fault::Transfer, Duration::ZERO),
                _ => (Fault::Resize, Duration::ZERO),
            };
            Step {
                fault,
                hold,
                settle: rng.millis(300, 1500),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_replays_and_different_seeds_differ() {
        let text = |seed| format!("{:?}", generate(seed, 8, &[]));
        assert_eq!(text(7), text(7));
        assert_ne!(text(7), text(8));
        let only = ["pause-leader".to_string(), "transfer".to_string()];
        let steps = generate(7, 8, &only);
        assert_eq!(steps.len(), 8);
        assert!(steps.iter().all(|s| only.contains(&s.fault.to_string())));
        assert!(generate(7, 3, &["no-such-fault".into()]).is_empty());
    }
}
