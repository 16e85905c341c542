//! `train_dict`: a zstd dictionary trained from the device's own pages, installed as a new
//! dictionary generation of a recompression priority. Retraining twice with pages still on
//! the old generations loses nothing; a generation no page uses is freed; every generation
//! held is `EBUSY`; bad input changes nothing. The model test retrains concurrently with every
//! other path (`service/tests/model.rs`).

use uzram::device::{Device, GenStat, RecompressSpec, TrainSpec};
use uzram_testkit::device::DeviceBuilder;
use uzram_testkit::pages::{check_pages, program_pages, write_pages, Program, PAGE};
use uzram_testkit::refused::{assert_refused, errno_of};

fn device(pages: u64) -> Device {
    DeviceBuilder::pages(pages)
        .attr("recomp_algorithm", "algo=zstd")
        .build()
}

fn gens(dev: &Device) -> GenStat {
    dev.dict_generations(1).unwrap()
}

fn train(dev: &Device, value: &str) {
    dev.attr_store("train_dict", value).unwrap();
}

#[test]
fn retraining_twice_keeps_every_page_readable_and_frees_old_generations() {
    let dir = tempfile::tempdir().unwrap();
    let dev = device(384);
    // Generation 0 (no dictionary): 128 pages recompressed with it.
    let a = program_pages(128, 1, Program::ZstdBeatsLz4);
    write_pages(&dev, 0, &a);
    dev.recompress(&RecompressSpec::default()).unwrap();
    let g = gens(&dev);
    assert_eq!(g.current, 0);
    let on_g0 = g.held[0].1;
    assert!(on_g0 > 0, "{g:?}");

    // Generation 1, trained from those pages and saved: the next 128 pages use it.
    let path = dir.path().join("gen1.dict");
    train(
        &dev,
        &format!("dict_size=16K samples=128 path={}", path.display()),
    );
    let saved = std::fs::read(&path).unwrap();
    assert!(!saved.is_empty() && saved.len() <= 16 << 10);
    assert_eq!(&saved[..4], &[0x37, 0xa4, 0x30, 0xec], "a zstd dictionary");
    let b = program_pages(128, 2, Program::ZstdBeatsLz4);
    write_pages(&dev, 128, &b);
    dev.recompress(&RecompressSpec::default()).unwrap();
    let g = gens(&dev);
    assert_eq!(g.current, 1);
    assert_eq!(g.held.len(), 2, "{g:?}");
    assert_eq!(
        g.held[0],
        (0, on_g0, 0),
        "generation 0 still holds its pages"
    );
    assert!(g.held[1].1 > 0 && g.held[1].2 == saved.len(), "{g:?}");

    // Generation 2: the next 128 pages. Every page of every generation reads back.
    train(&dev, "priority=1 dict_size=8K samples=256 level=5");
    let c = program_pages(128, 3, Program::ZstdBeatsLz4);
    write_pages(&dev, 256, &c);
    dev.recompress(&RecompressSpec::default()).unwrap();
    assert_eq!(gens(&dev).held.len(), 3, "{:?}", gens(&dev));
    check_pages(&dev, 0, &a);
    check_pages(&dev, 128, &b);
    check_pages(&dev, 256, &c);

    // Overwriting the pages of generations 0 and 1 frees them; generation 2 stays current.
    write_pages(&dev, 0, &program_pages(256, 4, Program::ZstdBeatsLz4));
    let g = gens(&dev);
    assert_eq!(g.current, 2);
    assert_eq!(
        g.held.iter().map(|h| h.0).collect::<Vec<_>>(),
        vec![2],
        "{g:?}"
    );
    check_pages(&dev, 0, &program_pages(256, 4, Program::ZstdBeatsLz4));
    check_pages(&dev, 256, &c);
    assert!(dev
        .attr_show("dict_stat")
        .unwrap()
        .starts_with("#1: current=2 2:"));
}

#[test]
fn every_generation_held_is_ebusy() {
    let dev = device(64);
    let pages = program_pages(64, 1, Program::ZstdBeatsLz4);
    write_pages(&dev, 0, &pages[..8]);
    // Each generation keeps a page: 8 generations, then the 9th training is EBUSY.
    for gen in 0..8 {
        let i = 8 + gen * 4;
        write_pages(&dev, i, &pages[i..i + 4]);
        dev.recompress(&RecompressSpec::default()).unwrap();
        assert_eq!(gens(&dev).held.len(), gen + 1, "{:?}", gens(&dev));
        let r = dev.attr_store("train_dict", "dict_size=4K samples=64");
        if gen < 7 {
            r.unwrap();
        } else {
            assert_eq!(r.unwrap_err().errno(), libc::EBUSY);
        }
    }
    check_pages(&dev, 0, &pages[..40]);
    // The failed training installed nothing.
    assert_eq!(gens(&dev).current, 7);
}

#[test]
fn bad_input_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    // Uninitialised: EINVAL.
    let dev = Device::new_uninit(PAGE).unwrap();
    dev.attr_store("recomp_algorithm", "algo=zstd").unwrap();
    assert_eq!(
        dev.attr_store("train_dict", "").unwrap_err().errno(),
        libc::EINVAL
    );
    assert_eq!(dev.attr_show("dict_stat").unwrap(), "");
    // No zstd recompression priority: EINVAL.
    let plain = Device::new_uninit(PAGE).unwrap();
    plain
        .attr_store("recomp_algorithm", "algo=deflate")
        .unwrap();
    plain.attr_store("disksize", "1M").unwrap();
    assert_eq!(
        plain.attr_store("train_dict", "").unwrap_err().errno(),
        libc::EINVAL
    );

    let dev = device(64);
    let pages = program_pages(64, 1, Program::ZstdBeatsLz4);
    write_pages(&dev, 0, &pages);
    let before = gens(&dev);
    // samples=1: one page teaches libzstd's trainer nothing.
    assert_refused(
        &[(
            libc::EINVAL,
            &[
                "dict_size=100",
                "dict_size=5M",
                "dict_size=x",
                "samples=0",
                "samples=x",
                "samples=100000",
                "samples",
                "algo=lz4",
                "priority=2",
                "priority=0",
                "level=x",
                "level=99",
                "samples=1",
            ],
        )],
        |value| errno_of(dev.attr_store("train_dict", value)),
        |value| assert_eq!(gens(&dev), before, "{value}"),
    );
    // A path that cannot be written: its errno, and nothing installed.
    let e = dev
        .attr_store(
            "train_dict",
            &format!("path={}", dir.path().join("no/such/dir/d").display()),
        )
        .unwrap_err();
    assert_eq!(e.errno(), libc::ENOENT, "{e}");
    assert_eq!(gens(&dev), before);
    check_pages(&dev, 0, &pages);
    // Write-only.
    assert_eq!(
        dev.attr_show("train_dict").unwrap_err().errno(),
        libc::EACCES
    );
    // The library form parses the same way.
    assert!(TrainSpec::parse("dict_size=16K samples=10 path=/tmp/x").is_ok());
}
