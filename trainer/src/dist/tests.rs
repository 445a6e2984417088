//! The collectives with ranks as threads over loopback TCP.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use super::*;

/// Runs `body(collective)` on `world` ranks (threads) connected through loopback TCP and
/// returns each rank's result in rank order.
fn on_ranks<T: Send>(
    world: usize,
    timeout: Duration,
    body: impl Fn(TcpCollective) -> T + Sync,
) -> Vec<T> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let body = &body;
    std::thread::scope(|s| {
        let mut handles =
            vec![s.spawn(move || body(TcpCollective::root(listener, world, timeout).unwrap()))];
        for rank in 1..world {
            handles.push(s.spawn(move || {
                body(TcpCollective::join("127.0.0.1", port, rank, world, timeout).unwrap())
            }));
        }
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn all_reduce_sums_in_rank_order_and_every_rank_gets_the_same_bits() {
    // Values whose float sum depends on the order: 1e8 + 1 + ... loses the ones unless
    // the order is fixed; every rank must end with rank 0's left-to-right sum.
    let values = |rank: usize| -> Vec<f32> {
        vec![
            [1e8f32, 1.0, -1e8, 0.1][rank],
            rank as f32 * 0.5,
            -(rank as f32),
        ]
    };
    let results = on_ranks(4, Duration::from_secs(30), |c| {
        let mut buf = values(c.rank());
        c.all_reduce_sum(&mut buf).unwrap();
        buf
    });
    let mut want = values(0);
    for rank in 1..4 {
        for (w, v) in want.iter_mut().zip(values(rank)) {
            *w += v;
        }
    }
    for (rank, got) in results.iter().enumerate() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(got), bits(&want), "rank {rank}");
    }
}

#[test]
fn broadcast_gather_and_barrier() {
    let results = on_ranks(3, Duration::from_secs(30), |c| {
        let rank = c.rank();
        let mut buf = vec![rank as f32; 5];
        c.broadcast(&mut buf, 2).unwrap();
        let mut from_zero = vec![rank as f32 + 10.0; 2];
        c.broadcast(&mut from_zero, 0).unwrap();
        let gathered = c.all_gather_bytes(&vec![rank as u8; rank]).unwrap();
        let numbers = c.all_gather_f64(&[rank as f64, -1.5]).unwrap();
        let sums = sum_f64(&c, &[rank as f64, 0.25]).unwrap();
        c.barrier().unwrap();
        (buf, from_zero, gathered, numbers, sums)
    });
    for (buf, from_zero, gathered, numbers, sums) in results {
        assert_eq!(buf, vec![2.0; 5]);
        assert_eq!(from_zero, vec![10.0; 2]);
        assert_eq!(gathered, vec![vec![], vec![1], vec![2, 2]]);
        assert_eq!(
            numbers,
            vec![vec![0.0, -1.5], vec![1.0, -1.5], vec![2.0, -1.5]]
        );
        assert_eq!(sums, vec![3.0, 0.75]);
    }
}

#[test]
fn tensors_reduce_and_broadcast_in_their_own_shape_and_dtype() {
    let results = on_ranks(2, Duration::from_secs(30), |c| {
        let dev = candle_core::Device::Cpu;
        let t = Tensor::new(&[[1f32, 2.0], [3.0, c.rank() as f32]], &dev).unwrap();
        let sum = c.all_reduce_sum_tensor(&t).unwrap();
        let half = t.to_dtype(DType::F16).unwrap();
        let from_one = c.broadcast_tensor(&half, 1).unwrap();
        (
            sum.to_vec2::<f32>().unwrap(),
            from_one.dtype(),
            from_one
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap(),
        )
    });
    for (sum, dtype, from_one) in results {
        assert_eq!(sum, vec![vec![2.0, 4.0], vec![6.0, 1.0]]);
        assert_eq!(dtype, DType::F16);
        assert_eq!(from_one, vec![vec![1.0, 2.0], vec![3.0, 1.0]]);
    }
}

#[test]
fn ranks_out_of_step_fail_naming_both_collectives() {
    let results = on_ranks(2, Duration::from_secs(30), |c| {
        if c.rank() == 0 {
            c.all_reduce_sum(&mut [1.0]).map(drop)
        } else {
            c.barrier()
        }
    });
    let err = results[0].as_ref().unwrap_err().to_string();
    assert!(
        err.contains("out of step") && err.contains("all-gather"),
        "{err}"
    );
}

#[test]
fn a_rank_that_exits_or_stops_answering_fails_the_collective_naming_it() {
    // Rank 1 leaves (its connection closes): rank 0 hears of it at its next collective.
    let results = on_ranks(2, Duration::from_secs(30), |c| {
        if c.rank() == 1 {
            return Ok(());
        }
        c.all_reduce_sum(&mut [1.0])
    });
    let err = results[0].as_ref().unwrap_err().to_string();
    assert!(err.contains("rank 1 closed its connection"), "{err}");
    // Rank 1 stays but never answers: rank 0 gives up after the timeout.
    let start = Instant::now();
    let results = on_ranks(2, Duration::from_secs(1), |c| {
        if c.rank() == 1 {
            std::thread::sleep(Duration::from_secs(3));
            return Ok(());
        }
        c.all_reduce_sum(&mut [1.0])
    });
    let err = results[0].as_ref().unwrap_err().to_string();
    assert!(
        err.contains("rank 1 did not answer rank 0 within 1 s"),
        "{err}"
    );
    assert!(start.elapsed() < Duration::from_secs(10));
}

#[test]
fn a_rendezvous_without_every_rank_times_out_naming_the_missing_ones() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let err = TcpCollective::root(listener, 3, Duration::from_millis(300)).unwrap_err();
    assert!(
        err.to_string().contains("rank(s) 1, 2 did not join"),
        "{err}"
    );
    // A rank whose WORLD_SIZE differs from rank 0's is refused.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let joiner = std::thread::spawn(move || {
        TcpCollective::join("127.0.0.1", port, 1, 3, Duration::from_secs(5)).map(drop)
    });
    let err = TcpCollective::root(listener, 2, Duration::from_secs(5)).unwrap_err();
    assert!(
        err.to_string().contains("WORLD_SIZE=3, rank 0 with 2"),
        "{err}"
    );
    assert!(joiner.join().unwrap().is_err());
}

#[test]
fn the_rendezvous_reads_torchrun_variables() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        move |name: &str| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    };
    assert_eq!(Rendezvous::from_vars(env(&[])).unwrap(), None);
    let rdv = Rendezvous::from_vars(env(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("MASTER_ADDR", "node0"),
        ("MASTER_PORT", "29500"),
    ]))
    .unwrap()
    .unwrap();
    assert_eq!(
        rdv,
        Rendezvous {
            addr: "node0".into(),
            port: 29500,
            rank: 3,
            world_size: 4,
            local_rank: 1,
            local_world_size: 2,
        }
    );
    let no_local = Rendezvous::from_vars(env(&[
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "1234"),
    ]))
    .unwrap()
    .unwrap();
    assert_eq!((no_local.local_rank, no_local.local_world_size), (1, 2));
    // Under torchrun's agent store rank 0 listens one port up, unless told a port.
    let torchrun = [
        ("RANK", "0"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
    ];
    let port = |extra: &'static [(&'static str, &'static str)]| {
        let pairs: Vec<_> = torchrun.iter().chain(extra).copied().collect();
        Rendezvous::from_vars(|name| {
            pairs
                .iter()
                .rev()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
        .unwrap()
        .unwrap()
        .port
    };
    assert_eq!(port(&[]), 29501);
    assert_eq!(port(&[("TORCHELASTIC_USE_AGENT_STORE", "False")]), 29500);
    assert_eq!(port(&[("DPPO_MASTER_PORT", "4000")]), 4000);
    for (vars, want) in [
        (&[("RANK", "0")][..], "WORLD_SIZE is not set"),
        (
            &[("RANK", "2"), ("WORLD_SIZE", "2")][..],
            "must be below WORLD_SIZE",
        ),
        (&[("RANK", "x"), ("WORLD_SIZE", "2")][..], "RANK=\"x\""),
        (
            &[("RANK", "0"), ("WORLD_SIZE", "2")][..],
            "MASTER_ADDR is not set",
        ),
        (
            &[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "h"),
                ("MASTER_PORT", "99999"),
            ][..],
            "MASTER_PORT=\"99999\"",
        ),
    ] {
        let pairs: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let err = Rendezvous::from_vars(|name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        })
        .unwrap_err()
        .to_string();
        assert!(err.contains(want), "{vars:?}: {err}");
    }
}

#[test]
fn shards_are_contiguous_cover_everything_and_differ_by_at_most_one() {
    for n in 0..20 {
        for world in 1..6 {
            let ranges: Vec<Range<usize>> = (0..world).map(|r| shard_range(n, r, world)).collect();
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[world - 1].end, n);
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start);
            }
            let sizes: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
            assert!(
                sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1,
                "{sizes:?}"
            );
        }
    }
}

#[test]
fn single_is_the_identity() {
    let s = Single;
    let mut buf = [1.5f32, -2.0];
    s.all_reduce_sum(&mut buf).unwrap();
    s.broadcast(&mut buf, 0).unwrap();
    assert_eq!(buf, [1.5, -2.0]);
    assert_eq!(s.all_gather_bytes(b"x").unwrap(), vec![b"x".to_vec()]);
    assert_eq!(sum_f64(&s, &[0.5]).unwrap(), vec![0.5]);
    assert_eq!((s.rank(), s.world_size()), (0, 1));
}
